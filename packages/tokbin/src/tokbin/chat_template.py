"""Chat templates rendered the way transformers renders them, in jinja2's sandbox, without transformers.

The environment is the one transformers' ``_compile_jinja_template`` builds (checked against transformers 5.25):
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols`` extension and a
``{% generation %}`` block tag (rendered as its body), the ``tojson`` filter that does not escape HTML and takes
``ensure_ascii``, ``indent``, ``separators`` and ``sort_keys``, and the globals ``raise_exception``,
``strftime_now``, ``dict`` and a ``namespace`` that refuses underscore names. ``render`` passes what
``apply_chat_template`` passes: ``messages`` (plain JSON data; keys whose value is None dropped; reasoning fields
aliased), ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), then any keyword arguments.

One difference, on purpose: an attribute the sandbox forbids (``''.__class__``) raises at once, where jinja2 would
print it as an empty string; a chat template is code from a download, and one that reaches for such attributes is
refused. Every failure is one :class:`ChatTemplateError` line naming the template's file and field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokbin.errors import TokenFileError
from tokbin.text_tokenizer import TemplateSource

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, first the standard one


class ChatTemplateError(TokenFileError):
    """A chat template that does not compile, refuses or fails to render, reaches outside its sandbox, or never
    writes an assistant turn. The message names the file and field (``tokenizer_config.json: chat_template: ...``)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' filter: jinja2's own escapes HTML characters, which would change the rendered text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: a call and ``fromkeys``, nothing to reach the type through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore-prefixed names (no route to CPython internals), as transformers'."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick (namespace(self=...))
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_', got {name!r}")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@lru_cache(maxsize=32)
def _compile(text: str) -> jinja2.Template:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(text)


def _plain(value: Any) -> Any:
    """A copy made of JSON types only (what transformers hands a template), so the template cannot mutate or reach
    into the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as apply_chat_template passes them: plain data, None values dropped, reasoning fields aliased."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]: expected a mapping with role and content, got {type(m).__name__}")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template and the variables it renders with (the tokenizer's special tokens).

    Example:
        >>> t = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
        ...                  "{% if add_generation_prompt %}<|assistant|>{% endif %}", {"eos_token": "</s>"})
        >>> t.render([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
        '<|user|>2+2?</s><|assistant|>'
        >>> ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        tokbin.chat_template.ChatTemplateError: <chat template>: chat_template: the template refused ...
    """

    def __init__(self, source: str | TemplateSource, variables: Mapping[str, Any] | None = None) -> None:
        self.source = source if isinstance(source, TemplateSource) else TemplateSource(source)
        self.variables = dict(variables or {})
        try:
            self._template = _compile(self.source.text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise self.error(
                f"not a valid Jinja template (line {e.lineno}: {e.message}): expected a template jinja2 compiles; "
                "fix the template"
            ) from None
        except jinja2.exceptions.TemplateError as e:
            raise self.error(f"does not compile ({type(e).__name__}: {e}): fix the template") from None

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template: str | TemplateSource | None = None) -> ChatTemplate:
        """``template`` (or the tokenizer's own ``chat_template``) with the tokenizer's special tokens as variables."""
        source = template if template is not None else getattr(tokenizer, "chat_template", None)
        if source is None:
            where = getattr(tokenizer, "path", None) or "<tokenizer>"
            raise ChatTemplateError(
                where,
                "chat_template: none found (no chat_template.jinja, no chat_template in tokenizer_config.json): "
                "expected a chat template; pass one (template=...) or add it to the model directory",
            )
        return cls(source, getattr(tokenizer, "special_tokens", {}))

    @property
    def where(self) -> str:
        """The field the template came from, as messages name it (``chat_template``, or the file's name)."""
        return self.source.field

    def error(self, message: str) -> ChatTemplateError:
        """A ChatTemplateError naming this template's file and field."""
        field = self.source.field
        return ChatTemplateError(self.source.origin, f"{field}: {message}" if field else message)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The text of ``messages`` (a list of ``{"role", "content"}``), as ``apply_chat_template(tokenize=False)``."""
        chat = plain_messages(messages)
        variables = {**self.variables, **_plain(kwargs)}
        try:
            return self._template.render(
                messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.SecurityError as e:
            raise self.error(
                f"tried to reach outside the sandbox ({e}): expected a template that only reads the messages and its "
                "variables; remove that expression (a chat template is untrusted code)"
            ) from None
        except jinja2.exceptions.TemplateSyntaxError as e:  # an {% include %} or similar, compiled on use
            raise self.error(f"not a valid Jinja template (line {e.lineno}: {e.message}): fix the template") from None
        except jinja2.exceptions.UndefinedError as e:
            raise self.error(
                f"failed to render the conversation (UndefinedError: {e}): expected messages with the fields this "
                "template reads (a list of {role, content}); change the messages or the template"
            ) from None
        except jinja2.exceptions.TemplateError as e:
            raise self.error(
                f"the template refused the conversation (raise_exception: {e}): expected a conversation it accepts; "
                "change the messages (roles, order) or the template"
            ) from None
        except Exception as e:  # the template's own expressions (a bad index, a type error, ...)
            raise self.error(
                f"failed to render the conversation ({type(e).__name__}: {e}): expected messages this template "
                "accepts (a list of {role, content}); change the messages or the template"
            ) from None
