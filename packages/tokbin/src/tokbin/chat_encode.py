"""A conversation to (ids, labels) through its chat template: the ids transformers' ``apply_chat_template`` gives,
labels on what the assistant says.

The ids are the tokenizer's encoding of the whole rendered text (no special tokens added), which is what
``apply_chat_template(messages, tokenize=True)`` returns. Labels are -100 everywhere except each assistant
message's content and its end-of-turn token. Where these lie is found by rendering, not by knowing the template:

1. ``upto = render(messages[:k+1])`` and ``before = render(messages[:k], add_generation_prompt=True)``; the turn of
   assistant message k spans ``[common_prefix(full, before), common_prefix(full, upto))`` of the full text. A
   template that renders the history differently once more turns follow (one that drops earlier reasoning, say)
   still shares the prefix up to where it changes.
2. The content is searched inside that turn, as given, else stripped (templates that ``trim`` it); searches run in
   message order so a reply quoted in an earlier turn is not taken for it. A reply the template rewrote (Qwen3's
   drops the reasoning of earlier turns) is the text from the turn's start to the first special token before the
   next message. Neither: the template never marks this assistant turn, and that is one ChatTemplateError line.
3. Tokens overlapping the content are labelled, then the turn's tail after it up to and including its last
   special token (``<|im_end|>`` of ``<|im_end|>\\n``: not the newline after it), or the whole tail when it holds
   no special token (a plain-text end marker such as a blank line). A template whose prefixes cannot be rendered
   (one that refuses a conversation ending with the assistant) falls back to the content and the token right
   after it when that token is special.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokbin.chat_template import ChatTemplate, ChatTemplateError
from tokbin.text_tokenizer import TemplateSource, Tokenizer

IGNORE_INDEX = -100
Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class ChatEncoding:
    """``ids`` and ``labels`` (aligned, unshifted: ``labels[t]`` is ``ids[t]`` or -100) and the rendered ``text``."""

    ids: list[int]
    labels: list[int]
    text: str


def _template(tokenizer: Tokenizer, template: ChatTemplate | str | TemplateSource | None) -> ChatTemplate:
    return template if isinstance(template, ChatTemplate) else ChatTemplate.for_tokenizer(tokenizer, template)


def _prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _find(text: str, content: str, start: int, end: int) -> tuple[int, int] | None:
    if not content.strip():
        return start, start  # nothing to find: an empty reply still has its end-of-turn token
    for variant in dict.fromkeys((content, content.strip())):
        at = text.find(variant, start, end)
        if at >= 0:
            return at, at + len(variant)
    return None


def _render_or_none(tpl: ChatTemplate, messages: Messages, generation: bool, kwargs: dict) -> str | None:
    try:
        return tpl.render(messages, add_generation_prompt=generation, **kwargs)
    except ChatTemplateError:
        return None


def _content(m: Mapping[str, Any]) -> str:
    content = m.get("content")
    return content if isinstance(content, str) else ""


def _rewritten(full: str, start: int, later: Messages, special_texts: Sequence[str]) -> tuple[int, int, int] | None:
    """The span of a reply the template rewrote (Qwen3's drops earlier turns' reasoning): from ``start`` to the first
    special token before the next message's content, that token ending the turn; None if nothing is there."""
    bound = next((at for at in (full.find(c, start) for c in map(_content, later) if c.strip()) if at >= 0), len(full))
    ends = [(at, len(t)) for t in special_texts if t and (at := full.find(t, start, bound)) >= 0]
    if not ends:
        return None
    at, length = min(ends)
    text_start = start + len(full[start:at]) - len(full[start:at].lstrip())
    return (text_start, at, at + length) if full[start:at].strip() else None


def assistant_spans(
    tpl: ChatTemplate, messages: Messages, full: str, special_texts: Sequence[str] = (), **kwargs: Any
) -> list[tuple[int, int, int]]:
    """(content start, content end, turn end) in ``full`` for each assistant message, in order; turn end is -1 where
    the prefixes could not be rendered (then only the token right after the content may be the end of turn).
    ``special_texts``: the tokenizer's special tokens, which end a reply the template rewrote."""
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        content = _content(m)
        if m.get("role") != "assistant":
            found = _find(full, content, cursor, len(full)) if content.strip() else None
            cursor = found[1] if found else cursor
            continue
        before = _render_or_none(tpl, messages[:k], True, kwargs) if k else ""
        upto = _render_or_none(tpl, messages[: k + 1], False, kwargs)
        start = max(cursor, _prefix(full, before)) if before is not None else cursor
        turn_end = _prefix(full, upto) if upto is not None else -1
        found = _find(full, content, start, turn_end if turn_end > start else len(full))
        if found is None:
            found = _find(full, content, start, len(full))  # a turn the prefixes did not bound cleanly
        span = None if found is None else (*found, max(turn_end, found[1]) if turn_end >= 0 else -1)
        if span is None:
            span = _rewritten(full, start, messages[k + 1 :], special_texts)
        if span is None:
            shown = content if len(content) <= 40 else content[:37] + "..."
            raise tpl.error(
                f"never marks assistant message {k} ({shown!r}): its content is not in the rendered text, so its "
                "tokens cannot be labelled; expected a template that writes each assistant turn (use the model's "
                "chat template, or pass one that renders assistant messages)"
            )
        spans.append(span)
        cursor = span[1]
    return spans


def _labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int, int]], special: frozenset):
    labels = [IGNORE_INDEX] * len(ids)
    starts = [s for s, _ in offsets]
    for c0, c1, turn_end in spans:
        i = bisect_left(starts, c0)
        while i > 0 and offsets[i - 1][1] > c0:  # a token that begins before the content and reaches into it
            i -= 1
        while i < len(ids) and offsets[i][0] < c1:  # tokens overlapping the content
            if offsets[i][1] > c0:
                labels[i] = ids[i]
            i += 1
        if turn_end < 0:  # no bound on the turn: the end-of-turn token is the next token, if special
            if i < len(ids) and ids[i] in special:
                labels[i] = ids[i]
            continue
        tail = range(i, bisect_left(starts, turn_end, lo=i))
        marks = [j for j in tail if ids[j] in special]
        for j in tail if not marks else range(i, marks[-1] + 1):
            labels[j] = ids[j]
    return labels


def encode_chat(
    tokenizer: Tokenizer,
    messages: Messages,
    *,
    template: ChatTemplate | str | TemplateSource | None = None,
    add_generation_prompt: bool = False,
    eos: bool = False,
    **template_kwargs: Any,
) -> ChatEncoding:
    """(ids, labels) of a conversation through ``template`` (default: the tokenizer's own chat template).

    ``ids`` equal ``transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=True,
    add_generation_prompt=...)`` for the same directory; labels are -100 except each assistant message's content and
    its end-of-turn token (see the module's docstring). ``eos`` appends the tokenizer's EOS id after the text,
    labelled when the last message is the assistant's: lmtrain's rule for its own templates, which write no EOS;
    templates of base models write their end tokens themselves, so it is off by default. ``template_kwargs`` reach
    the template as variables (after the special tokens), as apply_chat_template's ``**kwargs`` do.

    Example::

        tok = load_tokenizer("Qwen2-0.5B-Instruct")
        enc = encode_chat(tok, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
        [tok.id_to_token(i) for i, l in zip(enc.ids, enc.labels) if l != -100]  # ['4', '<|im_end|>']
    """
    tpl = _template(tokenizer, template)
    full = tpl.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    special_texts = [t for i, t in tokenizer.added_tokens.items() if i in tokenizer.special_ids]
    spans = assistant_spans(tpl, messages, full, special_texts, **template_kwargs)
    ids, offsets = tokenizer.encode_offsets(full)
    labels = _labels(ids, offsets, spans, tokenizer.special_ids)
    if eos:
        if tokenizer.eos_id is None:
            raise ChatTemplateError(
                tokenizer.path or "<tokenizer>", "eos_token: the tokenizer has none: expected one for eos=True"
            )
        last_is_reply = bool(messages) and messages[-1].get("role") == "assistant" and not add_generation_prompt
        ids.append(tokenizer.eos_id)
        labels.append(tokenizer.eos_id if last_is_reply else IGNORE_INDEX)
    return ChatEncoding(ids, labels, full)


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: Messages,
    *,
    template: ChatTemplate | str | TemplateSource | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """The ids to generate a reply from: the conversation so far and the template's generation prompt (the assistant
    header), as ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.

    Example::

        ids = chat_prompt_ids(tok, [{"role": "user", "content": "2+2?"}])  # ... <|im_start|>assistant\\n
    """
    tpl = _template(tokenizer, template)
    return tokenizer.encode(tpl.render(messages, add_generation_prompt=True, **template_kwargs))


def generation_prompt(
    tokenizer: Tokenizer, *, template: ChatTemplate | str | TemplateSource | None = None, **template_kwargs: Any
) -> str:
    """The text the template adds for ``add_generation_prompt`` after a user turn (``<|im_start|>assistant\\n`` for
    ChatML); empty for templates without one (Llama 2's, where the reply follows ``[/INST]`` directly)."""
    tpl = _template(tokenizer, template)
    user = [{"role": "user", "content": "x"}]
    with_prompt = tpl.render(user, add_generation_prompt=True, **template_kwargs)
    without = tpl.render(user, add_generation_prompt=False, **template_kwargs)
    return with_prompt[_prefix(with_prompt, without) :]
