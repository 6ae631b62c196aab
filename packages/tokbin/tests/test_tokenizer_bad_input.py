"""Every bad tokenizer directory and chat template: one TokenFileError line naming the file and field, what was
expected and what was found (and the CLI's exit 2 with that line)."""

import json

import pytest
from conftest import CHATML_TEMPLATE

from tokbin import ChatTemplateError, TokenFileError, encode_chat, load_tokenizer
from tokbin.cli import main

pytest.importorskip("tokenizers")

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
TRAILING_COMMA = '{"eos_token": "<|im_end|>",}'


def json_error(text: str) -> str:
    """json's own words for `text` (they changed in Python 3.13: "Illegal trailing comma before end of object")."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return f"{e.msg} at line {e.lineno} column {e.colno}"  # as tokbin words it
    raise AssertionError(f"{text!r} is valid JSON")


GOOD_CONFIG = {"eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE}

CASES = [
    # (id, files to write over a good directory (None: remove), what fails: "load" or "chat", expected words)
    ("no tokenizer.json", {"tokenizer.json": None}, "load",
     ["no tokenizer: expected tokenizer.json (a Hugging Face tokenizer) or one SentencePiece .model", "found neither"]),
    ("tokenizer.json not JSON", {"tokenizer.json": '{"version": "1.0", "model": '}, "load",
     ["tokenizer.json: not JSON (Expecting value at line 1 column 29)", "restore the file"]),
    ("tokenizer.json not a tokenizer", {"tokenizer.json": '{"model": {"type": "Nope"}}'}, "load",
     ["tokenizer.json: not a tokenizer the tokenizers library can load", "expected the tokenizer.json"]),
    ("tokenizer.json a list", {"tokenizer.json": "[1, 2]"}, "load",
     ["tokenizer.json: expected a Hugging Face tokenizer (a JSON object), found a JSON list"]),
    ("config not JSON", {"tokenizer_config.json": TRAILING_COMMA}, "load",
     [f"tokenizer_config.json: not JSON ({json_error(TRAILING_COMMA)})", "line 1 column"]),
    ("eos not in the vocabulary", {"tokenizer_config.json": {"eos_token": "<|eos|>"}}, "load",
     ["tokenizer_config.json: eos_token: '<|eos|>' is not a token of tokenizer.json", "fix the field"]),
    ("eos a number", {"tokenizer_config.json": {"eos_token": 7}}, "load",
     ["tokenizer_config.json: eos_token: expected a token (a string, or an object with a string 'content'), found 7"]),
    ("added token disagrees", {"tokenizer_config.json": {"added_tokens_decoder": {"5": {"content": "<|im_end|>"}}}},
     "load", ["tokenizer_config.json: added_tokens_decoder['5']: '<|im_end|>' has id 2 in tokenizer.json"]),
    ("named templates without default",
     {"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": "x"}]}}, "load",
     ["tokenizer_config.json: chat_template: expected a template named 'default'", "found ['tool_use']"]),
    ("template a number", {"tokenizer_config.json": {"chat_template": 3}}, "load",
     ["tokenizer_config.json: chat_template: expected a Jinja template (a string) or a list", "found int"]),
    ("no template", {"tokenizer_config.json": {"eos_token": "<|im_end|>"}}, "chat",
     ["chat_template: none found (no chat_template.jinja, no chat_template in tokenizer_config.json)"]),
    ("template syntax error", {"chat_template.jinja": "{% for m in messages %}{{ m.content }"}, "chat",
     ["chat_template.jinja: not a valid Jinja template (line 1: unexpected '}')", "fix the template"]),
    ("template raises", {"tokenizer_config.json": {**GOOD_CONFIG, "chat_template": "{{ raise_exception('no!') }}"}},
     "chat", ["tokenizer_config.json: chat_template: the template refused the conversation (raise_exception: no!)"]),
    ("template fails", {"chat_template.jinja": "{{ messages[5].content.upper() }}"}, "chat",
     ["chat_template.jinja: failed to render the conversation (UndefinedError:", "list object has no element 5"]),
    ("never marks the assistant turn",
     {"chat_template.jinja": "{% for m in messages if m.role == 'user' %}<|im_start|>{{ m.content }}<|im_end|>"
                             "{% endfor %}"},
     "chat", ["chat_template.jinja: never marks assistant message 1 ('hello')", "content is not in the rendered"]),
    *[(f"sandbox: {expr}", {"chat_template.jinja": "{{ " + expr + " }}"}, "chat",
       ["chat_template.jinja: tried to reach outside the sandbox", "is unsafe", "untrusted code"])
      for expr in ("''.__class__.__mro__", "''.__class__", "cycler.__init__.__globals__", "joiner.__init__",
                   "messages.__class__.__base__.__subclasses__()", "raise_exception.__globals__")],
    ("sandbox: namespace underscore", {"chat_template.jinja": "{% set ns = namespace(_x=1) %}{{ ns }}"}, "chat",
     ["tried to reach outside the sandbox (a namespace attribute may not start with '_', got '_x')"]),
    ("sandbox: mutate a message", {"chat_template.jinja": "{{ messages.append(1) }}"}, "chat",
     ["tried to reach outside the sandbox", "append"]),
]  # fmt: skip


@pytest.mark.parametrize(("files", "when", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_tokenizer_or_template_is_one_line(files, when, words, tmp_path, qwen_bpe):
    d = tmp_path / "model"
    d.mkdir()
    qwen_bpe.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(GOOD_CONFIG))
    for name, content in files.items():
        if content is None:
            (d / name).unlink()
        else:
            (d / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    with pytest.raises(TokenFileError) as info:
        tok = load_tokenizer(d)
        assert when == "chat", "loading should have failed"
        encode_chat(tok, MESSAGES)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(d)), message
    for word in words:
        assert word in message, message
    if when == "chat":
        assert isinstance(info.value, ChatTemplateError)


def test_cli_reports_a_broken_tokenizer_in_one_line(tmp_path, capsys, qwen_bpe):
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_text("{not json")
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    assert main(["encode", "--tokenizer", str(d), "--input", str(text), "--output", str(tmp_path / "o.bin")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokbin encode: error: {d}/tokenizer.json: not JSON") and err.count("\n") == 1
    assert not (tmp_path / "o.bin").exists()
