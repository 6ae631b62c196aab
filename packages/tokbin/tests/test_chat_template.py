"""Chat templates: the text and ids equal transformers' ``apply_chat_template`` (a ChatML/Qwen2 and a Llama 3 template,
both config layouts), labels on each assistant message's content and end-of-turn token only, and lmtrain's own
SentencePiece templates giving the ids and labels lmtrain.chat.encode_turns gives."""

import json

import pytest
from conftest import CHATML_TEMPLATE, write_hf_dir

from tokbin import ChatTemplate, chat_prompt_ids, encode_chat, generation_prompt, load_tokenizer, train_tokenizer

IGNORE = -100
CONVERSATIONS = {
    "system and several turns": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4.\n\n  (four)"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    "no system turn": [
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": " Padded reply with spaces  "},
    ],
    "a reply quoted earlier": [
        {"role": "user", "content": "Say yes"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "again: yes"},
        {"role": "assistant", "content": "yes"},
    ],
}
END = {"qwen": "<|im_end|>", "llama3": "<|eot_id|>"}


def _runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The labelled ids, as runs of consecutive labelled positions."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if label != IGNORE:
            assert label == token
            if i == 0 or labels[i - 1] == IGNORE:
                runs.append([])
            runs[-1].append(token)
    return runs


@pytest.fixture(scope="module")
def dirs(qwen_dir, llama3_dir):
    return {"qwen": qwen_dir, "llama3": llama3_dir}


@pytest.mark.parametrize("generation", [False, True], ids=["whole", "add_generation_prompt"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_ids_equal_apply_chat_template(kind, conversation, generation, dirs):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(dirs[kind])
    tok = load_tokenizer(dirs[kind])
    messages = CONVERSATIONS[conversation]
    if generation:
        messages = messages[:-1]
    enc = encode_chat(tok, messages, add_generation_prompt=generation)
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=False)
    assert enc.ids == expected
    assert enc.text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    if generation:
        assert chat_prompt_ids(tok, messages) == expected


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_labels_cover_each_reply_and_its_end_of_turn_token(kind, conversation, dirs):
    tok = load_tokenizer(dirs[kind])
    messages = CONVERSATIONS[conversation]
    enc = encode_chat(tok, messages)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    # Llama 3's template trims the content; ChatML writes it as it is
    expected = [(r.strip() if kind == "llama3" else r) + END[kind] for r in replies]
    assert [tok.decode(run) for run in _runs(enc.ids, enc.labels)] == expected
    end_id = tok.token_to_id(END[kind])
    labelled_ends = [i for i, (t, label) in enumerate(zip(enc.ids, enc.labels, strict=True)) if label == end_id]
    assert len(labelled_ends) == len(replies)
    if kind == "qwen":  # the newline after each reply's <|im_end|> belongs to no one's reply
        newline = tok.encode(END[kind] + "\n")[-1]
        assert all(enc.ids[i + 1] == newline and enc.labels[i + 1] == IGNORE for i in labelled_ends)
    headers = [i for i, t in enumerate(enc.ids) if t in tok.special_ids and t != end_id]
    assert headers and all(enc.labels[i] == IGNORE for i in headers)


def test_generation_prompt_and_eos(dirs):
    qwen, llama = load_tokenizer(dirs["qwen"]), load_tokenizer(dirs["llama3"])
    assert generation_prompt(qwen) == "<|im_start|>assistant\n"
    assert generation_prompt(llama) == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    messages = CONVERSATIONS["no system turn"]
    plain, with_eos = encode_chat(qwen, messages), encode_chat(qwen, messages, eos=True)
    assert with_eos.ids == [*plain.ids, qwen.eos_id] and with_eos.labels == [*plain.labels, qwen.eos_id]
    open_turn = encode_chat(qwen, messages[:1], eos=True)  # the conversation ends with the user: EOS not learned
    assert open_turn.labels[-1] == IGNORE and set(open_turn.labels) == {IGNORE}


@pytest.mark.parametrize("layout", ["config string", "named list", "jinja file over config"])
def test_template_layouts_equal_transformers(layout, tmp_path, qwen_bpe):
    transformers = pytest.importorskip("transformers")
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    template_file = None
    if layout == "config string":
        config["chat_template"] = CHATML_TEMPLATE
    elif layout == "named list":
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                   {"name": "default", "template": CHATML_TEMPLATE}]  # fmt: skip
    else:
        config["chat_template"] = "{{ 'the config template, overridden by the file' }}"
        template_file = CHATML_TEMPLATE
    d = write_hf_dir(tmp_path / "m", qwen_bpe, config, template_file)
    messages = CONVERSATIONS["system and several turns"]
    ref = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(messages, return_dict=False)
    assert encode_chat(load_tokenizer(d), messages).ids == ref


# Everything transformers' environment adds, used at once: tojson (non-ASCII and HTML kept, indent, sort_keys),
# namespace, dict, loop controls, strftime_now, the generation tag, and the special tokens as variables
ENVIRONMENT_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}
{% if ns.count >= 3 %}{% break %}{% endif -%}
{%- endfor -%}
{{ {'b': 'é <tag> & "q"', 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}
{{ dict(x=1, y='z') | tojson }} {{ strftime_now('no directives') }} {{ messages | length }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""  # noqa: E501


def test_environment_equals_transformers(qwen_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    tok = load_tokenizer(qwen_dir)
    messages = [*CONVERSATIONS["system and several turns"], {"role": "user", "content": "past the break"}]
    for generation in (False, True):
        expected = ref.apply_chat_template(messages, chat_template=ENVIRONMENT_TEMPLATE, tokenize=False,
                                           add_generation_prompt=generation)  # fmt: skip
        got = ChatTemplate.for_tokenizer(tok, ENVIRONMENT_TEMPLATE).render(messages, add_generation_prompt=generation)
        assert got == expected
    assert "past the break" not in got and '"é <tag> & \\"q\\""' in got


# lmtrain.chat's templates, as TOKENS_TEMPLATE.jinja() and PLAIN_TEMPLATE.jinja() write them
LMTRAIN_TOKENS = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{ \"<|system|>\" }}{%- elif message['role'] "
    "== 'user' %}{{ \"<|user|>\" }}{%- elif message['role'] == 'assistant' %}{{ \"<|assistant|>\" }}{%- endif %}"
    '{{ message[\'content\'] }}{{ "<|end|>" }}{%- endfor %}{%- if add_generation_prompt %}{{ "<|assistant|>" }}'
    "{%- endif %}"
)
LMTRAIN_PLAIN = (
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{ \"System:\\n\" }}{%- elif message['role'] "
    "== 'user' %}{{ \"User:\\n\" }}{%- elif message['role'] == 'assistant' %}{{ \"Assistant:\\n\" }}{%- endif %}"
    '{{ message[\'content\'] }}{{ "\\n\\n" }}{%- endfor %}{%- if add_generation_prompt %}{{ "Assistant:\\n" }}'
    "{%- endif %}"
)
LMTRAIN_PARTS = {
    "tokens": ({"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}, "<|end|>"),
    "plain": ({"system": "System:\n", "user": "User:\n", "assistant": "Assistant:\n"}, "\n\n"),
}


def _lmtrain_encode_turns(tok, headers, end, messages):
    """lmtrain.chat.encode_turns' rule: each part encoded on its own (line by line), assistant content and END
    labelled, then EOS, labelled after a final assistant turn."""
    ids, labels = [], []
    for m in messages:
        head = tok.encode(headers[m["role"]])
        body = tok.encode(m["content"]) + tok.encode(end)
        ids += head + body
        labels += [IGNORE] * len(head) + (body if m["role"] == "assistant" else [IGNORE] * len(body))
    ids.append(tok.eos_id)
    labels.append(tok.eos_id if messages[-1]["role"] == "assistant" else IGNORE)
    return ids, labels


@pytest.fixture(scope="module")
def lmtrain_spm(corpus, tmp_path_factory):
    """A tokenizer as `lmtrain prepare` trains one: lossless options, the chat tokens reserved."""
    prefix = tmp_path_factory.mktemp("lmtrain_spm") / "tokenizer"
    return train_tokenizer(
        [corpus], prefix, 500, byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2,
        user_defined_symbols=["\n", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    )  # fmt: skip


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", ["tokens", "plain"])
def test_lmtrain_templates_give_lmtrain_ids_and_labels(name, conversation, lmtrain_spm):
    tok = load_tokenizer(lmtrain_spm)
    template = ChatTemplate.for_tokenizer(tok, LMTRAIN_TOKENS if name == "tokens" else LMTRAIN_PLAIN)
    messages = CONVERSATIONS[conversation]
    enc = encode_chat(tok, messages, template=template, eos=True)
    assert (enc.ids, enc.labels) == _lmtrain_encode_turns(tok, *LMTRAIN_PARTS[name], messages)
    prompt = chat_prompt_ids(tok, messages[:-1], template=template)
    headers, _ = LMTRAIN_PARTS[name]
    assert prompt[-len(tok.encode(headers["assistant"])) :] == tok.encode(headers["assistant"])


def test_a_template_that_strips_history_still_labels_the_replies(qwen_dir):
    # like Qwen3's, which drops earlier turns' reasoning: the history renders differently as turns are added
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] | trim }}"
        "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = load_tokenizer(qwen_dir)
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>hm</think> a1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]  # fmt: skip
    enc = encode_chat(tok, messages, template=template)
    assert "hm" not in enc.text
    assert [tok.decode(r) for r in _runs(enc.ids, enc.labels)] == ["a1<|im_end|>", "a2<|im_end|>"]


def test_special_tokens_reach_the_template_as_variables(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    text = ChatTemplate.for_tokenizer(tok, "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}").render([])
    assert text == "<|im_end|>|<|endoftext|>|False"
    assert json.loads(
        ChatTemplate("{{ messages | tojson }}").render([{"role": "user", "content": "é", "x": None}])
    ) == [{"role": "user", "content": "é"}]  # None-valued keys dropped, as apply_chat_template does
