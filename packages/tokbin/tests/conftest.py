"""Shared fixtures. All text is generated from this Python's standard-library source, so the tests need nothing
outside the repository."""

import sysconfig
from pathlib import Path

import pytest
import torch

SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>"]
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3"}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def stdlib_text(n_bytes: int, skip_bytes: int = 0) -> str:
    """About ``n_bytes`` of whole standard-library source files (UTF-8 ones, sorted by path), after ``skip_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for p in sorted(root.rglob("*.py")):
        if any(part in SKIP_DIRS or part.startswith("test_") for part in p.relative_to(root).parts):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if skip_bytes > 0:
            skip_bytes -= len(text)
            continue
        parts.append(text)
        size += len(text.encode("utf-8"))
        if size >= n_bytes:
            break
    return "".join(parts)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 200 KB of real text: standard-library source, blank lines between its blocks."""
    path = tmp_path_factory.mktemp("corpus") / "stdlib_200k.txt"
    path.write_text(stdlib_text(200_000), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def wiki_text(tmp_path_factory) -> Path:
    """About 100 KB of other standard-library source (other files than ``corpus``), many blank-line blocks."""
    path = tmp_path_factory.mktemp("wiki") / "stdlib_100k.txt"
    path.write_text(stdlib_text(100_000, skip_bytes=400_000), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def lossless_model(corpus, tmp_path_factory) -> Path:
    """A byte-fallback BPE model that keeps whitespace and newlines as they are, so decode(encode(x)) == x."""
    from tokbin import train_tokenizer

    prefix = tmp_path_factory.mktemp("spm") / "lossless"
    return train_tokenizer(
        [corpus],
        prefix,
        500,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        user_defined_symbols=[*SPECIAL, "\n"],
        minloglevel=2,
    )


@pytest.fixture(scope="session")
def other_model(corpus, tmp_path_factory) -> Path:
    """A different tokenizer (unigram, default normalisation) for identity-mismatch tests."""
    from tokbin import train_tokenizer

    prefix = tmp_path_factory.mktemp("spm") / "other"
    return train_tokenizer([corpus], prefix, 500, model_type="unigram", minloglevel=2)


# ---- Hugging Face tokenizers, trained here with the `tokenizers` library (the hf extra) -----------------------------

# Qwen2's pre-tokenizer regex (its tokenizer.json, and transformers' Qwen2Tokenizer, use it with NFC and byte-level)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def train_byte_level_bpe(text: str, special: list[str], regex: str, *, nfc: bool = False, bos: str | None = None):
    """A byte-level BPE as Qwen2 and Llama 3 ship them (NFC for Qwen2, a split regex, byte-level bytes), trained on
    ``text``; ``bos`` adds a post-processor that puts it first, as Llama 3's does with add_special_tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # trained on runs of lines, not single lines, so that merges across line ends ("\n\n", "):\n") exist
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def write_hf_dir(directory: Path, tok, config: dict, template_file: str | None = None) -> Path:
    """A model directory as transformers writes one: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return directory


@pytest.fixture(scope="session")
def qwen_bpe():
    """A ChatML byte-level BPE with Qwen2's pipeline, trained on standard-library source."""
    return train_byte_level_bpe(stdlib_text(150_000), CHATML_SPECIAL, QWEN2_REGEX, nfc=True)


@pytest.fixture(scope="session")
def llama3_bpe():
    """A Llama-3-style byte-level BPE (header and end-of-turn tokens, BOS added by its post-processor)."""
    return train_byte_level_bpe(stdlib_text(150_000), LLAMA3_SPECIAL, LLAMA3_REGEX, bos="<|begin_of_text|>")


@pytest.fixture(scope="session")
def qwen_dir(qwen_bpe, tmp_path_factory) -> Path:
    """A Qwen2-style model directory in transformers 5's layout (template in chat_template.jinja)."""
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "unk_token": None}  # fmt: skip
    return write_hf_dir(tmp_path_factory.mktemp("qwen"), qwen_bpe, config, CHATML_TEMPLATE)


# Qwen2.5's ChatML template (its default system message shortened)
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Llama 3's template, less tools: BOS from the bos_token variable, the system turn with a date, content trimmed
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('26 Jul 2024') %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "{%- set system_message = messages[0]['content']|trim %}\n"
    "{%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "{%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


@pytest.fixture(scope="session")
def llama3_dir(llama3_bpe, tmp_path_factory) -> Path:
    """A Llama-3-style model directory in transformers 4's layout (template and added tokens in the config)."""
    decoder = {
        str(llama3_bpe.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True}
        for t in LLAMA3_SPECIAL
    }  # fmt: skip
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
              "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE,
              "clean_up_tokenization_spaces": True, "model_max_length": 131072}  # fmt: skip
    return write_hf_dir(tmp_path_factory.mktemp("llama3"), llama3_bpe, config)
