"""Chat data for fine-tuning: JSONL samples, the chat template, label masks, and packed or padded batches.

A sample is one JSON object per line, plain or gzip: ``{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}`` (the convention of Hugging Face chat datasets) or ``{"prompt": "...", "response": "..."}``
(with an optional ``"system"``); an optional ``"group"`` string keeps the samples of one group in one split. A
held-out share is chosen by a hash of each sample, or of its group (tokbin.HashSplit, as `prepare` holds out
documents), so the same file splits the same way anywhere.

The template renders each turn as ``HEADER(role) content END`` and closes the sample with EOS. A tokenizer that
`lmtrain prepare` trained holds the headers and END as single pieces (SentencePiece user-defined symbols, see
:data:`CHAT_TOKENS`); one without them gets a plain-text template (``"User:\\n"``, an empty line as END). The ids
are the concatenation of each part encoded on its own, equal to encoding the rendered text whole (the headers
and END are pieces, ``"\\n"`` is a piece, no dummy prefix), which is what the exported tokenizer's
``chat_template`` gives through ``apply_chat_template``. Only assistant turns carry labels: their content and
their END (and EOS after a final assistant turn); every other position is -100.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtrain.errors import LmtrainError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
# Reserved by `lmtrain prepare` in every new tokenizer (SentencePiece user-defined symbols): one piece each.
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

Turn = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class ChatTemplate:
    """How turns become text: a header per role and an end-of-turn marker. ``name`` is "tokens" (the headers and
    END are pieces of the tokenizer) or "plain" (text markers, for tokenizers prepared without them)."""

    name: str
    headers: dict[str, str]
    end: str

    def render(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> str:
        """The text of ``turns`` (no EOS: the tokenizer's own EOS id closes a training sample)."""
        text = "".join(self.headers[role] + content + self.end for role, content in turns)
        return text + (self.headers["assistant"] if add_generation_prompt else "")

    def jinja(self) -> str:
        """The same rendering as a Jinja chat template (what transformers' ``apply_chat_template`` runs).

        Example:
            >>> import jinja2
            >>> text = jinja2.Template(TOKENS_TEMPLATE.jinja()).render(
            ...     messages=[{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
            >>> text, text == TOKENS_TEMPLATE.render([("user", "2+2?")], add_generation_prompt=True)
            ('<|user|>2+2?<|end|><|assistant|>', True)
        """
        cases = "".join(
            f"{'{%- if' if i == 0 else '{%- elif'} message['role'] == {role!r} %}}{_jinja_text(header)}"
            for i, (role, header) in enumerate(self.headers.items())
        )
        return (
            "{%- for message in messages %}"
            + cases
            + "{%- endif %}{{ message['content'] }}"
            + _jinja_text(self.end)
            + "{%- endfor %}{%- if add_generation_prompt %}"
            + _jinja_text(self.headers["assistant"])
            + "{%- endif %}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "headers": dict(self.headers), "end": self.end}

    @classmethod
    def from_json(cls, value: Any, where: str) -> ChatTemplate:
        try:
            template = cls(str(value["name"]), {r: str(value["headers"][r]) for r in ROLES}, str(value["end"]))
        except (KeyError, TypeError) as exc:
            raise LmtrainError(
                f"{where}: chat_template: expected name, headers ({', '.join(ROLES)}) and end; "
                f"found {value!r} ({exc}); restore the file `lmtrain finetune` wrote"
            ) from None
        return template


def _jinja_text(text: str) -> str:
    return "{{ " + json.dumps(text) + " }}"


TOKENS_TEMPLATE = ChatTemplate(
    "tokens", {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}, "<|end|>"
)
PLAIN_TEMPLATE = ChatTemplate("plain", {"system": "System:\n", "user": "User:\n", "assistant": "Assistant:\n"}, "\n\n")


def pad_id_for(sp: Any) -> int:
    """The id that fills rows: the tokenizer's pad piece, else its unknown piece; never EOS, which closes a packed
    sample (a run of EOS padding would be as many one-token documents for the varlen attention, each its own
    call, which measured several times slower than the samples themselves)."""
    for i in (sp.pad_id(), sp.unk_id(), 0):
        if 0 <= i < sp.get_piece_size() and i != sp.eos_id():
            return int(i)
    return 1 if sp.eos_id() == 0 else 0


def template_for(sp: Any) -> ChatTemplate:
    """The tokens template when every chat token is a single piece of ``sp`` (user-defined), else the plain one."""
    ok = all(sp.piece_to_id(t) != sp.unk_id() and sp.is_control(sp.piece_to_id(t)) is False for t in CHAT_TOKENS)
    ok = ok and all(sp.encode(t) == [sp.piece_to_id(t)] for t in CHAT_TOKENS)
    return TOKENS_TEMPLATE if ok else PLAIN_TEMPLATE


# ---------------------------------------------------------------------------------------------- reading samples
@dataclass(frozen=True)
class Sample:
    """One chat sample: its turns and where it came from (file and line, for messages about it)."""

    turns: tuple[Turn, ...]
    line: int
    group: str | None = None

    def key(self) -> bytes:
        """The bytes the held-out split hashes: the sample's ``group`` when it has one (samples of one group, e.g.
        one source module, land in the same split), else its turns as canonical JSON (formatting does not count)."""
        if self.group is not None:
            return self.group.encode("utf-8")
        return json.dumps(self.turns, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def open_text(path: Path) -> Any:
    """``path`` opened for reading as UTF-8 text, through gzip when its first bytes say so."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """Every sample of the JSONL file ``path`` (plain or gzip); bad input is one LmtrainError naming the file and
    line, what was expected, what was found and the fix.

    Example:
        >>> import tempfile
        >>> work = tempfile.TemporaryDirectory()
        >>> path = Path(work.name) / "chat.jsonl"
        >>> _ = path.write_text('{"prompt": "2+2?", "response": "4"}\\n'
        ...     '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\\n')
        >>> [s.turns for s in read_samples(path)]
        [(('user', '2+2?'), ('assistant', '4')), (('user', 'hi'), ('assistant', 'yo'))]
        >>> _ = path.write_text('{"messages": [{"role": "bot", "content": "hi"}]}\\n')
        >>> read_samples(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lmtrain.errors.LmtrainError: .../chat.jsonl line 1: messages[0].role: expected one of system, user, ...
        >>> work.cleanup()
    """
    path = Path(path)
    if not path.is_file():
        raise LmtrainError(
            f"{path}: no such file: expected a JSONL file of chat samples (messages, or prompt/response)"
        )
    samples = []
    try:
        with open_text(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    turns, group = parse_sample(line, f"{path} line {number}")
                    samples.append(Sample(turns, number, group))
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise LmtrainError(
            f"{path}: unreadable ({type(exc).__name__}: {exc}): expected UTF-8 JSONL, plain or gzip"
        ) from None
    if not samples:
        raise LmtrainError(f"{path}: no samples: expected one JSON object per line (messages, or prompt/response)")
    return samples


def parse_sample(line: str, where: str) -> tuple[tuple[Turn, ...], str | None]:
    """The turns of one JSONL line (see :func:`read_samples`) and its optional ``group`` (a string)."""
    from lmtrain.text_codec import load_json_line

    fix = "fix or remove the line"
    obj = load_json_line(line, where)
    if not isinstance(obj, dict):
        raise LmtrainError(f"{where}: expected a JSON object, found {type(obj).__name__}; {fix}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise LmtrainError(
                f"{where}: messages: expected a list of {{role, content}}, found {type(messages).__name__}; {fix}"
            )
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise LmtrainError(
                    f"{where}: messages[{i}]: expected an object with role and content, found {type(m).__name__}; {fix}"
                )
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise LmtrainError(
                    f"{where}: messages[{i}].role: expected one of {', '.join(ROLES)}, found {role!r}; {fix}"
                )
            if not isinstance(content, str):
                raise LmtrainError(
                    f"{where}: messages[{i}].content: expected a string, found {type(content).__name__}; {fix}"
                )
            turns.append((role, content))
    elif "prompt" in obj or "response" in obj:
        for name in ("prompt", "response") + (("system",) if "system" in obj else ()):
            if not isinstance(obj.get(name), str):
                raise LmtrainError(f"{where}: {name}: expected a string, found {type(obj.get(name)).__name__}; {fix}")
        turns = ([("system", obj["system"])] if "system" in obj else []) + [
            ("user", obj["prompt"]),
            ("assistant", obj["response"]),
        ]
    else:
        raise LmtrainError(
            f"{where}: expected a 'messages' list or 'prompt' and 'response' fields, found keys "
            f"{sorted(obj)[:6]}; {fix}"
        )
    assistant = [c for r, c in turns if r == "assistant"]
    if not assistant:
        raise LmtrainError(f"{where}: expected at least one assistant turn (the text to learn), found none; {fix}")
    if not all(c.strip() for c in assistant):
        raise LmtrainError(f"{where}: expected every assistant turn to hold text, found an empty one; {fix}")
    group = obj.get("group")
    if group is not None and not isinstance(group, str):
        raise LmtrainError(
            f"{where}: group: expected a string (samples of one group share a split), found "
            f"{type(group).__name__}; {fix}"
        )
    return tuple(turns), group


def split_samples(samples: Sequence[Sample], val_fraction: float) -> tuple[list[Sample], list[Sample]]:
    """(train, held out): a sample is held out when the hash of its turns falls below ``val_fraction``."""
    import tokbin

    val = tokbin.HashSplit(val_fraction, "val")
    held = [val.keeps(zlib.crc32(s.key()), len(s.key())) for s in samples]
    return [s for s, h in zip(samples, held, strict=True) if not h], [
        s for s, h in zip(samples, held, strict=True) if h
    ]


# ---------------------------------------------------------------------------------------------- ids and labels
def encode_turns(
    sp: Any, template: ChatTemplate, turns: Sequence[Turn], *, eos: bool = True
) -> tuple[list[int], list[int]]:
    """(ids, labels) of a sample, aligned (labels[t] is ids[t] or -100; the caller shifts them by one): assistant
    content and its END carry labels, and the EOS that closes a sample whose last turn is the assistant's.

    Example (a tokenizer `lmtrain prepare` trained, with the chat tokens reserved):
        >>> import tempfile
        >>> import sentencepiece as spm
        >>> from lmtrain.examples import tiny_data
        >>> work = tempfile.TemporaryDirectory()
        >>> sp = spm.SentencePieceProcessor(model_file=str(tiny_data(work.name) / "tokenizer.model"))
        >>> ids, labels = encode_turns(sp, template_for(sp), [("user", "x"), ("assistant", "y")])
        >>> [sp.id_to_piece(i) for i in ids]
        ['<|user|>', 'x', '<|end|>', '<|assistant|>', 'y', '<|end|>', '</s>']
        >>> [sp.id_to_piece(i) if i >= 0 else i for i in labels]
        [-100, -100, -100, -100, 'y', '<|end|>', '</s>']
        >>> work.cleanup()
    """
    from lmtrain.text_codec import encode

    ids: list[int] = []
    labels: list[int] = []
    for role, content in turns:
        head = encode(sp, template.headers[role])
        body = encode(sp, content) + encode(sp, template.end)
        ids += head + body
        labels += [IGNORE_INDEX] * len(head) + (body if role == "assistant" else [IGNORE_INDEX] * len(body))
    if eos:
        ids.append(sp.eos_id())
        labels.append(sp.eos_id() if turns and turns[-1][0] == "assistant" else IGNORE_INDEX)
    return ids, labels


@dataclass(frozen=True)
class Encoded:
    """The samples of a split as (ids, labels) lists, with how many were truncated and skipped."""

    samples: list[tuple[list[int], list[int]]]
    truncated: int
    skipped: int


def encode_samples(
    sp: Any, template: ChatTemplate, samples: Sequence[Sample], seq_len: int, too_long: str = "truncate"
) -> Encoded:
    """Every sample encoded with ``template`` (:func:`encode_turns`), as :func:`encode_samples_with` says."""
    return encode_samples_with(lambda turns: encode_turns(sp, template, turns), samples, seq_len, too_long)


def encode_samples_with(
    encode: Callable[[Sequence[Turn]], tuple[list[int], list[int]]],
    samples: Sequence[Sample],
    seq_len: int,
    too_long: str = "truncate",
) -> Encoded:
    """Every sample encoded by ``encode(turns) -> (ids, labels)`` (this module's templates, or a base model's own:
    lmtrain.base_model.chat_encoder); one longer than ``seq_len + 1`` tokens is cut to its first ``seq_len + 1``
    (``too_long="truncate"``: the end of the sample goes, and with it its EOS) or left out (``"skip"``). A truncated
    sample with no label left is left out too. Both are counted."""
    out, truncated, skipped = [], 0, 0
    for s in samples:
        ids, labels = encode(s.turns)
        if len(ids) > seq_len + 1:
            if too_long == "skip":
                skipped += 1
                continue
            ids, labels = ids[: seq_len + 1], labels[: seq_len + 1]
            if all(v == IGNORE_INDEX for v in labels[1:]):
                skipped += 1
                continue
            truncated += 1
        out.append((ids, labels))
    return Encoded(out, truncated, skipped)


# ---------------------------------------------------------------------------------------------- batches
def pack_rows(
    samples: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int
) -> list[tuple[list[int], list[int]]]:
    """Samples laid into rows of ``seq_len + 1`` tokens in order, a sample never split across rows (a new row starts
    when the next one does not fit), the rest of a row padded with ``pad_id`` and -100. With the model's
    ``document_separator`` set to EOS, attention stays inside each sample (each ends with EOS).

    Example:
        >>> pack_rows([([5, 6, 2], [-100, 6, 2]), ([7, 2], [-100, 2]), ([8, 9, 9, 2], [-100, 9, 9, 2])], 5, 2)
        [([5, 6, 2, 7, 2, 2], [-100, 6, 2, -100, 2, -100]), ([8, 9, 9, 2, 2, 2], [-100, 9, 9, 2, -100, -100])]
    """
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for s_ids, s_labels in samples:
        if ids and len(ids) + len(s_ids) > seq_len + 1:
            rows.append((ids + [pad_id] * (seq_len + 1 - len(ids)), labels + [IGNORE_INDEX] * (seq_len + 1 - len(ids))))
            ids, labels = [], []
        ids, labels = ids + s_ids, labels + s_labels
    if ids:
        rows.append((ids + [pad_id] * (seq_len + 1 - len(ids)), labels + [IGNORE_INDEX] * (seq_len + 1 - len(ids))))
    return rows


def pad_batch(samples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    """(inputs, targets) of one batch of samples, each padded on the right to the longest (pad labels -100)."""
    import torch

    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (s_ids, s_labels) in enumerate(samples):
        ids[row, : len(s_ids)] = torch.tensor(s_ids)
        labels[row, : len(s_labels)] = torch.tensor(s_labels)
    return ids[:, :-1], labels[:, 1:]  # (B, T - 1): position t predicts label t + 1


class ChatBatches:
    """Training batches over the encoded samples, epoch after epoch in a seeded order, ``micro_batch`` rows per
    batch, this rank's share of every global batch: rows packed (``batching="pack"``) or one sample per row padded
    to the batch's longest (``"pad"``). ``state_dict``/``load_state_dict`` hold the position (exact resume)."""

    def __init__(
        self,
        samples: Sequence[tuple[list[int], list[int]]],
        seq_len: int,
        micro_batch: int,
        pad_id: int,
        *,
        batching: str = "pack",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batching not in ("pack", "pad"):
            raise LmtrainError(f"--batching {batching!r}: expected pack or pad")
        self.samples, self.seq_len, self.micro_batch, self.pad_id = list(samples), seq_len, micro_batch, pad_id
        self.batching, self.seed, self.rank, self.world_size = batching, seed, rank, world_size
        self.epoch, self.batch = 0, 0  # the next batch to yield

    def _epoch_units(self, epoch: int) -> list[tuple[list[int], list[int]]]:
        import random

        order = list(range(len(self.samples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        ordered = [self.samples[i] for i in order]
        return pack_rows(ordered, self.seq_len, self.pad_id) if self.batching == "pack" else ordered

    def batches_per_epoch(self) -> int:
        return len(self._epoch_units(0)) // (self.micro_batch * self.world_size)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.batches_per_epoch() == 0:
            raise LmtrainError(
                f"the training split has {len(self.samples)} sample(s), fewer than one global batch of "
                f"{self.micro_batch * self.world_size} rows: add samples or lower micro_batch"
            )
        while True:
            units = self._epoch_units(self.epoch)
            per_step = self.micro_batch * self.world_size
            while self.batch < len(units) // per_step:
                start = self.batch * per_step + self.rank * self.micro_batch
                mine = units[start : start + self.micro_batch]
                self.batch += 1
                yield pad_batch(mine, self.pad_id)
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch and the rows of it already drawn by all ranks together (a count that holds on
        any number of ranks: a resume on another world size continues at the same row)."""
        return {"epoch": self.epoch, "batch": self.batch, "rows": self.batch * self.micro_batch * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        per_batch = self.micro_batch * self.world_size
        rows = int(state["rows"]) if "rows" in state else None  # positions saved before the count was kept
        self.batch = int(state["batch"]) if rows is None else -(-rows // per_batch)


def eval_batches(
    samples: Sequence[tuple[list[int], list[int]]], micro_batch: int, pad_id: int, *, rank: int = 0, world_size: int = 1
) -> Any:
    """A zero-argument callable yielding the held-out samples as padded batches (this rank's share): trainloop's
    evaluation weighs each batch by its count of labels, so its loss is the mean over every response token."""

    def batches() -> Iterator[tuple[Any, Any]]:
        mine = list(samples)[rank::world_size]
        for i in range(0, len(mine), micro_batch):
            yield pad_batch(mine[i : i + micro_batch], pad_id)

    return batches
