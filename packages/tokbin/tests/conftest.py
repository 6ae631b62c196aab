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
