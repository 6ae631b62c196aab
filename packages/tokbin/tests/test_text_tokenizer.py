"""The tokenizer interface: a SentencePiece model and a Hugging Face tokenizer.json behind one protocol, loaded by
``load_tokenizer``; the HF ids equal the ``tokenizers`` library's own, and its special tokens those transformers
reads from tokenizer_config.json (transformers 4 and 5 layouts). The HF tests skip without ``tokenizers`` (their
fixtures ask for it); the SentencePiece ones run anyway."""

import hashlib
import json
import pickle
import shutil
import subprocess
import sys

import pytest
import sentencepiece as spm
from conftest import CHATML_TEMPLATE, LLAMA3_SPECIAL, write_hf_dir

from tokbin import (
    HFTokenizer,
    SentencePieceTokenizer,
    TemplateSource,
    TokenFileError,
    Tokenizer,
    load_tokenizer,
    tokenizer_sha256,
)

TEXTS = [
    "def f(x):\n    return x + 1\n\n\n    indented after blank lines\n",
    "Hello, world! 123 4567 café  naïve 😀\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    "   ",
]


def test_load_tokenizer_picks_the_kind(qwen_dir, lossless_model, tmp_path):
    assert isinstance(load_tokenizer(qwen_dir), HFTokenizer)
    assert isinstance(load_tokenizer(qwen_dir / "tokenizer.json"), HFTokenizer)
    assert isinstance(load_tokenizer(lossless_model), SentencePieceTokenizer)
    (tmp_path / "spm").mkdir()
    shutil.copy(lossless_model, tmp_path / "spm" / "tokenizer.model")
    assert isinstance(load_tokenizer(tmp_path / "spm"), SentencePieceTokenizer)
    both = tmp_path / "both"  # a Llama 2 directory holds tokenizer.model and tokenizer.json: the JSON is used
    shutil.copytree(qwen_dir, both)
    shutil.copy(lossless_model, both / "tokenizer.model")
    assert isinstance(load_tokenizer(both), HFTokenizer)
    processor = spm.SentencePieceProcessor(model_file=str(lossless_model))
    wrapped = load_tokenizer(processor)
    assert isinstance(wrapped, SentencePieceTokenizer) and wrapped.sha256 == load_tokenizer(lossless_model).sha256
    tok = load_tokenizer(qwen_dir)
    assert load_tokenizer(tok) is tok and isinstance(tok, Tokenizer)


def test_hf_ids_equal_the_tokenizers_library(qwen_dir, qwen_bpe):
    tok = load_tokenizer(qwen_dir)
    for text in TEXTS:
        expected = qwen_bpe.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == expected
        ids, offsets = tok.encode_offsets(text)
        assert ids == expected and len(offsets) == len(ids)
        assert tok.decode(expected) == text
    assert tok.encode_batch(TEXTS) == [qwen_bpe.encode(t, add_special_tokens=False).ids for t in TEXTS]
    # the special tokens written in text are matched whole, as apply_chat_template's tokenization does
    assert tok.encode("<|im_end|>") == [qwen_bpe.token_to_id("<|im_end|>")]


def test_special_tokens_are_added_only_when_asked(llama3_dir, llama3_bpe):
    tok = load_tokenizer(llama3_dir)
    bos = llama3_bpe.token_to_id("<|begin_of_text|>")
    assert tok.encode("hi there")[0] != bos
    assert tok.encode("hi there", add_special_tokens=True) == [bos, *tok.encode("hi there")]
    assert tok.encode_batch(["hi"], add_special_tokens=True) == [[bos, *tok.encode("hi")]]


def test_special_tokens_in_both_config_layouts(qwen_dir, llama3_dir, qwen_bpe, llama3_bpe):
    qwen = load_tokenizer(qwen_dir)  # transformers 5: no added_tokens_decoder, template in chat_template.jinja
    assert (qwen.eos_id, qwen.pad_id, qwen.bos_id) == (qwen_bpe.token_to_id("<|im_end|>"), 0, None)
    assert qwen.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert qwen.special_ids == {0, 1, 2}
    assert qwen.added_tokens == {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}
    assert qwen.chat_template == TemplateSource(CHATML_TEMPLATE, str(qwen_dir / "chat_template.jinja"), "")
    assert qwen.vocab_size == qwen_bpe.get_vocab_size() and qwen.unk_id is None
    llama = load_tokenizer(llama3_dir)  # transformers 4: added_tokens_decoder and the template in the config
    assert llama.bos_id == llama3_bpe.token_to_id("<|begin_of_text|>")
    assert llama.eos_id == llama3_bpe.token_to_id("<|eot_id|>")
    assert llama.special_ids == {llama3_bpe.token_to_id(t) for t in LLAMA3_SPECIAL}
    assert llama.chat_template is not None and llama.chat_template.origin == str(llama3_dir / "tokenizer_config.json")
    assert llama.token_to_id("<|eot_id|>") == llama.eos_id and llama.id_to_token(llama.eos_id) == "<|eot_id|>"
    assert llama.token_to_id("no such token") is None and llama.id_to_token(10**6) is None


def test_special_tokens_equal_what_transformers_reads(qwen_dir, llama3_dir):
    transformers = pytest.importorskip("transformers")
    for directory in (qwen_dir, llama3_dir):
        ref = transformers.AutoTokenizer.from_pretrained(directory)
        tok = load_tokenizer(directory)
        assert (tok.eos_id, tok.bos_id, tok.pad_id) == (ref.eos_token_id, ref.bos_token_id, ref.pad_token_id)
        assert tok.special_tokens == ref.special_tokens_map
        assert tok.vocab_size == len(ref)


def test_named_templates_legacy_map_and_the_jinja_file_first(tmp_path, qwen_bpe):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    d = write_hf_dir(tmp_path / "named", qwen_bpe, {"chat_template": named})
    template = load_tokenizer(d).chat_template
    assert template is not None and (template.text, template.field) == ("DEFAULT", "chat_template[1].template")
    d = write_hf_dir(tmp_path / "jinja", qwen_bpe, {"chat_template": "FROM CONFIG"}, template_file="FROM FILE")
    assert load_tokenizer(d).chat_template.text == "FROM FILE"  # type: ignore[union-attr]
    d = write_hf_dir(tmp_path / "legacy", qwen_bpe, {"tokenizer_class": "Qwen2Tokenizer"})
    legacy = {"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False}}  # fmt: skip
    (d / "special_tokens_map.json").write_text(json.dumps(legacy))
    assert load_tokenizer(d).eos_id == qwen_bpe.token_to_id("<|im_end|>")
    (d / "tokenizer_config.json").unlink()  # no config at all: a tokenizer without roles or template
    bare = load_tokenizer(d)
    assert bare.chat_template is None and bare.encode("hi") == qwen_bpe.encode("hi").ids


def test_identity_is_the_sha256_of_tokenizer_json(tmp_path, qwen_dir):
    tok = load_tokenizer(qwen_dir)
    assert tok.sha256 == hashlib.sha256((qwen_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tokenizer_sha256(qwen_dir) == tokenizer_sha256(qwen_dir / "tokenizer.json") == tok.sha256
    copy = shutil.copytree(qwen_dir, tmp_path / "copy")
    (copy / "chat_template.jinja").write_text("{{ messages }}")  # the template is not part of the identity ...
    assert load_tokenizer(copy).sha256 == tok.sha256
    assert load_tokenizer(copy).chat_template.sha256 != tok.chat_template.sha256  # type: ignore[union-attr]
    data = json.loads((copy / "tokenizer.json").read_text())  # ... the mapping between text and ids is
    data["added_tokens"].append({**data["added_tokens"][-1], "id": data["added_tokens"][-1]["id"] + 1000,
                                 "content": "<|new|>"})  # fmt: skip
    (copy / "tokenizer.json").write_text(json.dumps(data))
    assert load_tokenizer(copy).sha256 != tok.sha256


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_pickling_ships_the_serialized_tokenizer(kind, request, lossless_model, tmp_path):
    qwen_dir = request.getfixturevalue("qwen_dir") if kind == "hf" else None
    tok = load_tokenizer(qwen_dir if kind == "hf" else lossless_model)
    moved = tmp_path / "moved"  # the worker does not read the path again
    shutil.copytree(qwen_dir, moved) if kind == "hf" else shutil.copy(lossless_model, moved)
    again = pickle.loads(pickle.dumps(load_tokenizer(moved)))
    (shutil.rmtree if kind == "hf" else lambda p: p.unlink())(moved)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    for name in ("sha256", "vocab_size", "eos_id", "bos_id", "pad_id", "unk_id", "special_ids", "special_tokens"):
        assert getattr(again, name) == getattr(tok, name), name
    assert (again.chat_template and again.chat_template.text) == (tok.chat_template and tok.chat_template.text)


def test_sentencepiece_keeps_its_line_by_line_unit(lossless_model):
    sp = spm.SentencePieceProcessor(model_file=str(lossless_model))
    tok = load_tokenizer(lossless_model)
    text = "to be\nor not\n\n<|user|>x<|end|>  café 😀"
    assert tok.encode(text) == [i for line in text.splitlines(keepends=True) for i in sp.encode(line)]
    ids, offsets = tok.encode_offsets(text)
    assert ids == tok.encode(text) and tok.decode(ids) == text
    # each id spans the characters it came from: a character split into byte pieces is every piece's span
    spans = [span for span, nxt in zip(offsets, [*offsets[1:], None], strict=True) if span != nxt]
    assert "".join(text[a:b] for a, b in spans) == text
    emoji = text.index("😀")
    assert sum(1 for span in offsets if span == (emoji, emoji + 1)) == len(tok.encode("😀")) > 1
    assert {tok.id_to_token(i) for i in tok.special_ids} >= {"<s>", "</s>", "<|user|>", "<|end|>", "\n"}
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert tok.token_to_id("<|end|>") == sp.piece_to_id("<|end|>") and tok.token_to_id("zzzzqq") is None
    assert tok.encode("x", add_special_tokens=True) == [sp.bos_id(), *sp.encode("x")]
    assert tok.sha256 == tokenizer_sha256(lossless_model) == hashlib.sha256(lossless_model.read_bytes()).hexdigest()
    assert tok.decode([*ids, 10**6]) == text  # ids past the vocabulary (a padded model) are dropped


def test_missing_extra_is_one_line_naming_it(tmp_path):
    qwen_dir = tmp_path / "model"  # the extra is asked for before the file is read
    qwen_dir.mkdir()
    (qwen_dir / "tokenizer.json").write_text("{}")
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"
        "from tokbin import load_tokenizer, TokenFileError\n"
        "try:\n"
        f"    load_tokenizer({str(qwen_dir)!r})\n"
        "except TokenFileError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    from tokbin.extras import install_hint

    assert out.stdout.strip().endswith(f"needs the tokenizers package: {install_hint('hf')}"), out.stderr
    assert "tokenizer.json" in out.stdout and len(out.stdout.strip().splitlines()) == 1


def test_a_bad_path_is_one_line(tmp_path):
    with pytest.raises(TokenFileError, match=r"empty: no tokenizer: expected tokenizer.json .* found neither"):
        load_tokenizer((tmp_path / "empty").mkdir() or tmp_path / "empty")
