"""What a Hugging Face tokenizer directory says besides tokenizer.json: the special-token roles and the chat template,
in transformers 4's layout and in 5's.

- Roles (``bos_token``, ``eos_token``, ``pad_token``, ...) come from tokenizer_config.json, each a string, an
  ``AddedToken`` object (``{"content": ..., ...}``, transformers 4) or null; a role missing there is taken from a
  legacy special_tokens_map.json when there is one. ``added_tokens_decoder`` (transformers 4 writes it; 5 leaves it
  to tokenizer.json) says which ids are special.
- The chat template: a ``chat_template.jinja`` file beside the config (transformers 5 writes it there) takes
  priority, as it does in transformers; else the config's ``chat_template``, a string or a list of named templates
  (``[{"name": "default", "template": ...}, ...]``), of which the one named "default" is used.

Every malformed value is one TokenFileError naming the file and field, what was expected, what was found, the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokbin.errors import TokenFileError
from tokbin.text_tokenizer import SPECIAL_TOKEN_ROLES, TemplateSource

CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # transformers 4's legacy file; read only for roles the config lacks
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class HFConfig:
    """The parts of tokenizer_config.json (and its neighbours) a tokenizer uses."""

    roles: dict[str, str] = field(default_factory=dict)  # "eos_token" -> "<|im_end|>"
    # added_tokens_decoder: id -> (text, special)
    special_flags: dict[int, tuple[str, bool]] = field(default_factory=dict)
    chat_template: TemplateSource | None = None
    origin: str = CONFIG  # the config's path, for messages about it

    def to_json(self) -> dict[str, Any]:
        """A plain form to pickle to worker processes."""
        template = None if self.chat_template is None else vars(self.chat_template)
        flags = {str(k): list(v) for k, v in self.special_flags.items()}
        return {"roles": self.roles, "special_flags": flags, "chat_template": template, "origin": self.origin}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> HFConfig:
        template = value["chat_template"]
        return cls(
            dict(value["roles"]),
            {int(k): (v[0], bool(v[1])) for k, v in value["special_flags"].items()},
            None if template is None else TemplateSource(**template),
            value["origin"],
        )


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; anything else is one TokenFileError line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenFileError(path, f"not UTF-8 at byte {e.start}: expected {what} (JSON); restore the file") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenFileError(
            path,
            f"not JSON ({e.msg} at line {e.lineno} column {e.colno}): expected {what}; restore the file the model "
            "came with (or save the tokenizer again with transformers' save_pretrained)",
        ) from None
    if not isinstance(value, dict):
        raise TokenFileError(path, f"expected {what} (a JSON object), found a JSON {type(value).__name__}")
    return value


def _token_text(value: Any, path: Path, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenFileError(
        path,
        f"{where}: expected a token (a string, or an object with a string 'content'), found {json.dumps(value)[:80]}"
        "; fix the field or remove it",
    )


def _template_from_config(value: Any, path: Path) -> TemplateSource | None:
    if value is None:
        return None
    if isinstance(value, str):
        return TemplateSource(value, str(path), "chat_template")
    if isinstance(value, list):
        names = []
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
                raise TokenFileError(
                    path, f"chat_template[{i}]: expected an object with 'name' and 'template' strings, found {entry!r}"
                )
            names.append(entry["name"])
            if entry["name"] == "default":
                if not isinstance(entry.get("template"), str):
                    raise TokenFileError(
                        path,
                        f"chat_template[{i}].template: expected the template's text (a string), found "
                        f"{type(entry.get('template')).__name__}",
                    )
                return TemplateSource(entry["template"], str(path), f"chat_template[{i}].template")
        raise TokenFileError(
            path,
            f"chat_template: expected a template named 'default' among the named templates, found {names}; name "
            "one of them 'default' or pass the template to use",
        )
    raise TokenFileError(
        path,
        f"chat_template: expected a Jinja template (a string) or a list of named templates, found "
        f"{type(value).__name__}",
    )


def read_hf_config(directory: Path) -> HFConfig:
    """The special-token roles, special ids and chat template of the Hugging Face tokenizer in ``directory``.

    Example::

        cfg = read_hf_config(Path("Qwen2-0.5B"))
        cfg.roles["eos_token"], cfg.chat_template.origin  # ('<|endoftext|>', 'Qwen2-0.5B/tokenizer_config.json')
    """
    path = directory / CONFIG
    config = read_json_object(path, "the tokenizer's settings") if path.is_file() else {}
    roles: dict[str, str] = {}
    for role in SPECIAL_TOKEN_ROLES:
        text = _token_text(config.get(role), path, role)
        if text is not None:
            roles[role] = text
    legacy = directory / SPECIAL_TOKENS_MAP
    if legacy.is_file() and "added_tokens_decoder" not in config:
        mapping = read_json_object(legacy, "special-token roles")
        for role in SPECIAL_TOKEN_ROLES:
            if role not in roles and role not in config:
                text = _token_text(mapping.get(role), legacy, role)
                if text is not None:
                    roles[role] = text
    flags: dict[int, tuple[str, bool]] = {}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenFileError(path, f"added_tokens_decoder: expected an object of id -> token, found {decoder!r:.80}")
    for key, entry in decoder.items():
        text = _token_text(entry, path, f"added_tokens_decoder[{key!r}]")
        if not key.isdigit() or text is None:
            raise TokenFileError(
                path, f"added_tokens_decoder[{key!r}]: expected an id (digits) mapped to a token, found {entry!r:.80}"
            )
        flags[int(key)] = (text, bool(isinstance(entry, dict) and entry.get("special", False)))
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            template: TemplateSource | None = TemplateSource(jinja.read_text(encoding="utf-8"), str(jinja), "")
        except UnicodeDecodeError as e:
            raise TokenFileError(jinja, f"not UTF-8 at byte {e.start}: expected a Jinja chat template") from None
    else:
        template = _template_from_config(config.get("chat_template"), path)
    return HFConfig(roles, flags, template, str(path))
