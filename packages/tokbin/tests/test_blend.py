import json
import math
import os

import numpy as np
import pytest
import torch

from tokbin import Blend, BlendWindows, Loader, TokenFileError, write_tokens

TOKENIZER = "ab" * 32  # the tokenizer identity recorded in every source's header
VOCAB = 3000
# Source i holds ids in [1000 i, 1000 (i + 1)), so any row of a batch tells which source it was read from.
SIZES = {"web.bin": 60_000, "books.bin": 25_000, "code.bin": 9_000}
WEIGHTS = {"web.bin": 0.7, "books.bin": 0.2, "code.bin": 0.1}


def _write(path, n_tokens, band, *, vocab_size=VOCAB, tokenizer_sha256=TOKENIZER, eos_id=None):
    rng = np.random.default_rng(band)
    ids = rng.integers(1000 * band, 1000 * (band + 1), size=n_tokens)
    return write_tokens(path, ids, vocab_size=vocab_size, eos_id=eos_id, tokenizer_sha256=tokenizer_sha256)


@pytest.fixture
def data_dir(tmp_path):
    """Three token files and a spec `mix.json` naming them with weights 0.7 / 0.2 / 0.1."""
    for band, (name, n) in enumerate(SIZES.items()):
        _write(tmp_path / name, n, band)
    _spec(tmp_path / "mix.json", [{"path": name, "weight": w} for name, w in WEIGHTS.items()])
    return tmp_path


def _spec(path, sources, **extra):
    path.write_text(json.dumps({"sources": sources, **extra}))
    return path


def _source_of(x: torch.Tensor) -> np.ndarray:
    return x[:, 0].numpy() // 1000


def test_gather_reads_the_concatenation_of_the_sources(data_dir):
    blend = Blend.from_spec(data_dir / "mix.json")
    ids = np.concatenate([np.asarray(s.tokens) for s in blend.sources]).astype(np.int64)
    assert blend.n_tokens == ids.size == sum(SIZES.values()) and blend.vocab_size == VOCAB
    assert blend.sizes == tuple(SIZES.values()) and list(blend.offsets) == [0, 60_000, 85_000, 94_000]
    starts = [np.array([0, 84_000 - 1, 60_000, 93_000 - 1]), np.array([5]), np.array([59_000 - 1, 90_000])]
    for (x, y), st in zip(blend.gather_many(starts, 1000), starts, strict=True):
        want = np.stack([ids[s : s + 1001] for s in st])
        assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:])
        assert x.is_contiguous() and y.is_contiguous()
    (x, _), (x2, _) = blend.gather_many([np.array([60_000, 61_000]), np.array([62_000])], 16)  # one source only
    assert np.array_equal(x.numpy()[:, 0], ids[[60_000, 61_000]]) and x2[0, 0] == ids[62_000]


def test_read_windows_and_a_blend_of_blends(data_dir):
    blend = Blend.from_spec(data_dir / "mix.json")
    ids = np.concatenate([np.asarray(s.tokens) for s in blend.sources])
    starts = np.array([92_999, 0, 60_000, 59_000 - 1])  # 92,999 + 1001 is the end of the last source
    rows = blend.read_windows(starts, 1001)
    assert rows.dtype == np.uint16 and np.array_equal(rows, np.stack([ids[s : s + 1001] for s in starts]))
    web, books = blend.sources[:2]
    nested = Blend([Blend([web, books], [1, 1]), blend.sources[2]], [3, 1])
    assert nested.n_tokens == blend.n_tokens and np.array_equal(nested.read_windows(starts, 1001), rows)
    with pytest.raises(IndexError, match="is not inside one source"):
        nested.read_windows(np.array([60_000 - 3]), 4)  # inside the inner blend, across its two sources
    with pytest.raises(IndexError, match="exceed the 60000 tokens"):
        web.read_windows(np.array([60_000 - 3]), 4)
    with pytest.raises(ValueError, match="expected 1-D starts and length >= 1"):
        blend.read_windows(np.array([0]), 0)


@pytest.mark.parametrize("start", [60_000 - 16, 94_000 - 16, -1, 94_000])
def test_gather_refuses_a_window_outside_one_source(data_dir, start):
    blend = Blend.from_spec(data_dir / "mix.json")
    with pytest.raises(IndexError, match="is not inside one source"):
        blend.gather(np.array([0, start]), 16)


def test_loader_draws_sources_in_proportion_to_their_weights(data_dir):
    # N = 200 batches x 64 rows = 12,800 independent draws; the rows from source i are Binomial(N, p_i), so a
    # count more than 5 standard deviations sqrt(N p (1 - p)) from N p has probability below 6e-7 per source.
    blend = Blend.from_spec(data_dir / "mix.json")
    counts = np.zeros(3, dtype=int)
    with Loader(blend, blend.sampler(128, 64, seed=11)) as loader:
        for _ in range(200):
            x, y = next(loader)
            source = _source_of(x)
            assert (x.numpy() // 1000 == source[:, None]).all()  # no window mixes two sources
            assert (y.numpy() // 1000 == source[:, None]).all()
            counts += np.bincount(source, minlength=3)
    n = counts.sum()
    assert n == 12_800
    for count, p in zip(counts, WEIGHTS.values(), strict=True):
        assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (count, n * p)


def test_loader_resumes_a_blend_exactly_mid_stream(data_dir):
    spec = data_dir / "mix.json"

    def make():
        blend = Blend.from_spec(spec)
        return Loader(blend, blend.sampler(64, 8, seed=3), max_prefetch=3)

    with make() as reference:
        expected = [next(reference) for _ in range(100)]
    with make() as first:
        for _ in range(70):  # past the sampler's first 64-step chunk, with batches prefetched beyond step 70
            next(first)
        state = json.loads(json.dumps(first.state_dict()))
    assert state["sampler"]["step"] == 70
    with make() as resumed:
        resumed.load_state_dict(state)
        got = [next(resumed) for _ in range(30)]
    for (x1, y1), (x2, y2) in zip(expected[70:], got, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_ranks_read_disjoint_rows_of_one_stream(data_dir):
    blend = Blend.from_spec(data_dir / "mix.json")
    world = 2
    single = blend.sampler(32, 8 * world, seed=7)
    with Loader(blend, single) as whole:
        want = [next(whole)[0] for _ in range(10)]
    per_rank = []
    for rank in range(world):
        with Loader(blend, blend.sampler(32, 8, seed=7, rank=rank, world_size=world)) as loader:
            per_rank.append([next(loader)[0] for _ in range(10)])
    for step in range(10):
        for rank in range(world):
            assert torch.equal(per_rank[rank][step], want[step][rank::world])


def test_paths_are_relative_to_the_spec_not_the_working_directory(data_dir, tmp_path_factory, monkeypatch):
    (data_dir / "sub").mkdir()
    _write(data_dir / "sub" / "more.bin", 5_000, 2)
    spec = _spec(data_dir / "nested.json", [{"path": "web.bin", "weight": 1}, {"path": "sub/more.bin", "weight": 3}])
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    blend = Blend.from_spec(os.path.relpath(spec))
    assert [s.path.name for s in blend.sources] == ["web.bin", "more.bin"]
    assert list(blend.probabilities) == [0.25, 0.75] and blend.weights == (1.0, 3.0)
    assert isinstance(blend.sampler(16, 2, seed=0), BlendWindows)


def _bad_spec(data_dir, case):
    """The text of a bad spec file for ``case`` (None: no file), and what its error must say."""
    web = {"path": "web.bin", "weight": 1}
    cases = {
        "negative weight": (
            [web, {"path": "books.bin", "weight": -0.5}],
            "sources[1].weight: expected a finite number >= 0, found -0.5",
        ),
        "string weight": (
            [{"path": "web.bin", "weight": "1"}],
            "sources[0].weight: expected a finite number >= 0, found '1'",
        ),
        "bool weight": ([{"path": "web.bin", "weight": True}], "sources[0].weight: expected a finite number"),
        "zero-sum weights": (
            [{"path": "web.bin", "weight": 0}, {"path": "books.bin", "weight": 0}],
            "the weights sum to 0",
        ),
        "missing weight": ([{"path": "web.bin"}], "sources[0].weight: missing"),
        "unknown source key": ([{**web, "name": "web"}], "sources[0]: unknown key 'name'"),
        "missing file": ([web, {"path": "gone.bin", "weight": 1}], "sources[1].path: no such file"),
        "absolute path": ([{"path": str(data_dir / "web.bin"), "weight": 1}], "sources[0].path: '/"),
        "dot-dot path": (
            [web, {"path": "sub/../../web.bin", "weight": 1}],
            "sources[1].path: 'sub/../../web.bin' contains '..'",
        ),
        "link outside": ([{"path": "link.bin", "weight": 1}], "sources[0].path: 'link.bin' resolves outside"),
        "empty path": ([{"path": "", "weight": 1}], "sources[0].path: expected a file name"),
        "no sources": ([], "sources: expected a non-empty list"),
        "unknown key": (
            '{"sources": [{"path": "web.bin", "weight": 1}], "mix": 1}',
            "unknown key 'mix': expected only ['sources']",
        ),
        "not an object": ("[1, 2]", "expected a JSON object"),
        "not JSON": ("{not json", "unreadable blend spec: expected JSON"),
        "no spec file": (None, "no such file: expected a blend spec"),
    }
    content, message = cases[case]
    return (json.dumps({"sources": content}) if isinstance(content, list) else content), message


BAD_SPECS = [
    "negative weight",
    "string weight",
    "bool weight",
    "zero-sum weights",
    "missing weight",
    "unknown source key",
    "missing file",
    "absolute path",
    "dot-dot path",
    "link outside",
    "empty path",
    "no sources",
    "unknown key",
    "not an object",
    "not JSON",
    "no spec file",
]


def _spec_error(spec) -> str:
    """The message Blend.from_spec(spec) fails with, checked to be one line that starts with the spec's path."""
    with pytest.raises(TokenFileError) as err:
        Blend.from_spec(spec)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{spec}: "), text
    return text


@pytest.mark.parametrize("case", BAD_SPECS)
def test_bad_specs_are_one_line_errors_naming_the_file_and_field(data_dir, tmp_path_factory, case):
    outside = tmp_path_factory.mktemp("outside")
    _write(outside / "secret.bin", 1_000, 0)
    (data_dir / "link.bin").symlink_to(outside / "secret.bin")
    content, message = _bad_spec(data_dir, case)
    spec = data_dir / "bad.json"
    if content is not None:
        spec.write_text(content)
    assert message in _spec_error(spec)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"tokenizer_sha256": "cd" * 32}, f"tokenizer_sha256 is '{'cd' * 32}', sources[0] ("),
        ({"tokenizer_sha256": None}, "tokenizer_sha256 is none recorded, sources[0] ("),
        ({"vocab_size": VOCAB + 1}, f"vocab_size is {VOCAB + 1}, sources[0] ("),
    ],
    ids=["other tokenizer", "no tokenizer", "other vocab size"],
)
def test_sources_from_other_tokenizers_are_refused(data_dir, header, message):
    _write(data_dir / "odd.bin", 2_000, 1, **header)
    spec = _spec(data_dir / "odd.json", [{"path": "web.bin", "weight": 1}, {"path": "odd.bin", "weight": 1}])
    text = _spec_error(spec)
    assert text.startswith(f"{spec}: sources[1] ({data_dir / 'odd.bin'}): ") and message in text, text
    assert "must be encoded with one tokenizer" in text


def test_sources_with_different_eos_ids_are_refused(tmp_path):
    a = _write(tmp_path / "a.bin", 1_000, 0, eos_id=2)
    b = _write(tmp_path / "b.bin", 1_000, 1, eos_id=3)
    c = _write(tmp_path / "c.bin", 1_000, 1)  # no EOS recorded: mixes with either
    assert Blend([a, c], [1, 1]).eos_id == 2
    with pytest.raises(TokenFileError, match=r"different EOS ids \[2, 3\]"):
        Blend([a, b], [1, 1])


def test_blend_without_a_spec_names_the_source_file(tmp_path):
    a = _write(tmp_path / "a.bin", 1_000, 0)
    b = _write(tmp_path / "b.bin", 1_000, 1, vocab_size=VOCAB + 1)
    with pytest.raises(TokenFileError, match=f"^{tmp_path / 'b.bin'}: vocab_size is {VOCAB + 1}, "):
        Blend([a, b], [1, 1])
    with pytest.raises(ValueError, match="weights must not all be 0"):
        Blend([a, a], [0, 0])
    with pytest.raises(ValueError, match="one weight per source"):
        Blend([a], [1, 1])
