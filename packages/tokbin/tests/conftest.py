from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
WIKITEXT = DATA / "wikitext-2" / "valid.txt"
SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"test data {path} is absent (expected ../shared/data next to the repository root)")
    return path


def _head(source: Path, n_bytes: int, out: Path) -> Path:
    """The first whole lines of `source` within `n_bytes`, written to `out` (a tmp path, never into the repo)."""
    text = _need(source).read_bytes()[:n_bytes]
    out.write_bytes(text[: text.rindex(b"\n") + 1])
    return out


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 200 KB of real text: the head of TinyShakespeare."""
    return _head(SHAKESPEARE, 200_000, tmp_path_factory.mktemp("corpus") / "shakespeare_200k.txt")


@pytest.fixture(scope="session")
def wiki_text(tmp_path_factory) -> Path:
    """About 100 KB of WikiText-2 validation text, blank-line separated articles."""
    return _head(WIKITEXT, 100_000, tmp_path_factory.mktemp("wiki") / "wiki_100k.txt")


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
        user_defined_symbols=SPECIAL,
        minloglevel=2,
    )


@pytest.fixture(scope="session")
def other_model(corpus, tmp_path_factory) -> Path:
    """A different tokenizer (unigram, default normalisation) for identity-mismatch tests."""
    from tokbin import train_tokenizer

    prefix = tmp_path_factory.mktemp("spm") / "other"
    return train_tokenizer([corpus], prefix, 500, model_type="unigram", minloglevel=2)
