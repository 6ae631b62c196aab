"""A Hugging Face ``tokenizer.json`` behind the :class:`tokbin.text_tokenizer.Tokenizer` interface, through the
``tokenizers`` library (the ``hf`` extra; transformers is never imported).

Identity: ``sha256`` is the SHA-256 of the bytes of ``tokenizer.json`` alone, the file that defines every mapping
between text and ids (vocabulary, merges, normalizer, pre-tokenizer, added tokens). tokenizer_config.json is not
part of it: the special-token roles it names are recorded on their own (a token file's header keeps the EOS id), and
the chat template has its own ``chat_template.sha256``, so a run can check either. Two directories with the same
tokenizer.json bytes encode every text to the same ids.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokbin.errors import TokenFileError
from tokbin.hf_config import HFConfig, read_hf_config, read_json_object
from tokbin.text_tokenizer import TemplateSource

TOKENIZER_JSON = "tokenizer.json"
# Pipeline pieces that act on each pre-token, or on characters one by one, and add nothing at the start of a text:
# cutting a text after a line end between two printable non-space ASCII characters leaves their output unchanged
# where no pre-token spans such a line end (a whitespace run there is that one line end: GPT-2's \s+(?!\S) splits a
# longer run's last character off by what follows it).
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_LOCAL_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
_CUT = re.compile(r"(?<=[!-~])\n(?=[!-~])")
# Texts whose every cut at _CUT must give the ids of the whole: code, prose, numbers, punctuation and indentation
# around line ends, blank-line runs, non-ASCII letters.
_CUT_PROBES = (
    "def f(x):\n    return x * 2  # twice\n\n\nclass A:\n\tpass\n)\n]\n}\n's\n're\n",
    "First line.\nSecond, with 1234567 and 3.14159;\n\nThird: über café 東京 — done!\n!?\n-- end\n",
    '  \n\t\n \r\nx\n\n\n\n#\n##\n1\n22\n333\n\\n\n"quoted"\n<tag>\n</tag>\n',
)


def _tokenizers(path: object) -> Any:
    try:
        import tokenizers
    except ImportError:
        from tokbin.extras import install_hint

        hint = install_hint("hf")
        raise TokenFileError(path, f"a Hugging Face tokenizer needs the tokenizers package: {hint}") from None
    return tokenizers


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the special-token roles and chat template of its directory.

    ``encode`` equals ``tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids`` (the ids transformers'
    ``apply_chat_template`` builds from a rendered chat); pickling ships the tokenizer.json text and the config.

    Example::

        tok = HFTokenizer.load("Qwen2-0.5B")
        tok.encode("<|im_start|>user\\nhi<|im_end|>\\n")  # the special tokens matched whole
        tok.eos_id, tok.special_tokens["eos_token"], tok.vocab_size, tok.sha256
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, config: HFConfig, *, path: str | os.PathLike, sha256: str) -> None:
        tokenizers = _tokenizers(path)
        directory = Path(path)
        self.path: Path | None = directory  # Optional as in the Tokenizer protocol; always set here
        self.sha256 = sha256
        self._json = tokenizer_json
        self._config = config
        source = directory / TOKENIZER_JSON if directory.is_dir() else directory
        try:
            self.backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust parser raises a bare Exception naming the field it could not read
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenFileError(
                source,
                f"not a tokenizer the tokenizers library can load ({reason}): expected the tokenizer.json a "
                "transformers tokenizer saves; restore the file the model came with",
            ) from None
        added = {int(i): t.content for i, t in self.backend.get_added_tokens_decoder().items()}
        special = {int(i) for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        cfg_path = Path(config.origin)
        for i, (text, is_special) in config.special_flags.items():
            if self.backend.token_to_id(text) != i:
                raise TokenFileError(
                    cfg_path,
                    f"added_tokens_decoder[{str(i)!r}]: {text!r} has id {self.backend.token_to_id(text)} in "
                    f"{TOKENIZER_JSON}: expected the two files of one tokenizer; restore them from the same model",
                )
            if is_special:
                special.add(i)
        self.added_tokens = added
        self.special_tokens = dict(config.roles)
        ids: dict[str, int | None] = {}
        for role, text in config.roles.items():
            i = self.backend.token_to_id(text)
            if i is None:
                raise TokenFileError(
                    cfg_path,
                    f"{role}: {text!r} is not a token of {TOKENIZER_JSON}: expected a token of the vocabulary "
                    "(transformers would add it as a new id the model has no row for); fix the field",
                )
            ids[role] = i
            special.add(i)
        self.bos_id, self.eos_id, self.pad_id = ids.get("bos_token"), ids.get("eos_token"), ids.get("pad_token")
        unk = config.roles.get("unk_token") or getattr(self.backend.model, "unk_token", None)
        self.unk_id = self.backend.token_to_id(unk) if isinstance(unk, str) else None
        self.special_ids = frozenset(special)
        size = self.backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(size, max(added, default=-1) + 1)
        self.chat_template: TemplateSource | None = config.chat_template

    @classmethod
    def load(cls, directory: str | os.PathLike, tokenizer_json: str | os.PathLike | None = None) -> HFTokenizer:
        """Read ``directory``'s tokenizer.json (or ``tokenizer_json``), tokenizer_config.json and chat template."""
        directory = Path(directory)
        source = Path(tokenizer_json) if tokenizer_json is not None else directory / TOKENIZER_JSON
        if not source.is_file():
            raise TokenFileError(
                source,
                "no such file: expected the Hugging Face tokenizer.json of the model; copy it from the model "
                "the base came with (transformers' save_pretrained writes it)",
            )
        _tokenizers(source)  # the missing extra before anything else
        raw = source.read_bytes()
        read_json_object(source, "a Hugging Face tokenizer")  # one line for a file that is not JSON
        config = read_hf_config(directory)
        return cls(raw.decode("utf-8"), config, path=directory, sha256=hashlib.sha256(raw).hexdigest())

    @functools.cached_property
    def cuts_at_line_ends(self) -> bool:
        """Whether a text cut after a line end between two printable non-space ASCII characters encodes, piece by
        piece, to the ids of the whole: True for byte-level BPEs (GPT-2's, Llama 3's, Qwen2's), whose pre-tokens
        never span such a line end; False where the pipeline adds to a text's start (Metaspace, a prepended
        normalizer, ``add_prefix_space``) or sees more than a pre-token. Decided from tokenizer.json and checked on
        probe texts; tokbin's encoder reads a document in pieces only when it is True."""
        spec = json.loads(self._json)
        normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
        if not (_parts_within(normalizer, _LOCAL_NORMALIZERS, "normalizers") and pre is not None
                and _parts_within(pre, _LOCAL_PRE_TOKENIZERS, "pretokenizers")):  # fmt: skip
            return False
        if any(_CUT.search(token) for token in self.added_tokens.values()):
            return False
        for text in _CUT_PROBES:
            cuts = [0, *(m.end() for m in _CUT.finditer(text)), len(text)]
            pieces = [text[a:b] for a, b in itertools.pairwise(cuts)]
            if sum(self.encode_batch(pieces), []) != self.encode(text):
                return False
        return True

    def __reduce__(self):
        # worker processes rebuild from the JSON text (no path read again, no Rust object pickled)
        return (_rebuild, (self._json, self._config.to_json(), str(self.path), self.sha256))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size})"

    # ---- encoding ----------------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; the tokenizer's post-processor (BOS, say) runs only with ``add_special_tokens``."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` of each text (threads across texts unless ``TOKENIZERS_PARALLELISM=false``)."""
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [list(e.ids) for e in batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each id's (start, end) character span in ``text``."""
        e = self.backend.encode(text, add_special_tokens=False)
        return list(e.ids), [(int(a), int(b)) for a, b in e.offsets]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids outside the vocabulary (a model's padded rows) are dropped."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if skip_special_tokens:
            kept = [i for i in kept if i not in self.special_ids]
        return self.backend.decode(kept, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))


def _parts_within(part: dict[str, Any] | None, allowed: set[str], nested: str) -> bool:
    """Whether a normalizer or pre-tokenizer of tokenizer.json (None: none) is built of ``allowed`` types only (a
    ``Sequence`` holds its parts under ``nested``); ByteLevel only without ``add_prefix_space``."""
    if part is None:
        return True
    if part.get("type") == "Sequence":
        return all(_parts_within(p, allowed, nested) for p in part.get(nested) or [])
    if part.get("type") == "ByteLevel" and part.get("add_prefix_space"):
        return False
    return part.get("type") in allowed


def _rebuild(tokenizer_json: str, config: dict[str, Any], path: str, sha256: str) -> HFTokenizer:
    return HFTokenizer(tokenizer_json, HFConfig.from_json(config), path=path, sha256=sha256)
