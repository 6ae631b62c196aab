import itertools
import json

import numpy as np
import pytest

from tokbin import BlendWindows, DocumentLengths, DynamicLength, EpochWindows, RandomWindows, SeqLenWarmup


def _take(sampler, n):
    return [(s.copy(), t) for s, t in itertools.islice(iter(sampler), n)]


def _same(a, b):
    if len(a) != len(b):
        return False
    return all(t1 == t2 and np.array_equal(s1, s2) for (s1, t1), (s2, t2) in zip(a, b, strict=True))


FACTORIES = {
    "random": lambda **kw: RandomWindows(10_000, 32, 8, **kw),
    "epoch": lambda **kw: EpochWindows(10_000, 32, 8, **kw),
    "dynamic": lambda **kw: DynamicLength(10_000, 256, SeqLenWarmup(16, 128, 20), **kw),
    "blend": lambda **kw: BlendWindows([6_000, 3_000, 1_000], [0.7, 0.2, 0.1], 32, 8, **kw),
}


@pytest.mark.parametrize("kind", FACTORIES)
def test_deterministic_and_seed_dependent(kind):
    make = FACTORIES[kind]
    a, b, c = _take(make(seed=1), 150), _take(make(seed=1), 150), _take(make(seed=2), 150)
    assert _same(a, b) and not _same(a, c)


@pytest.mark.parametrize("kind", FACTORIES)
def test_exact_resume_from_state(kind):
    make = FACTORIES[kind]
    full = _take(make(seed=3), 200)
    first = make(seed=3)
    _take(first, 77)
    state = first.state_dict()
    resumed = make(seed=3)
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 123), full[77:])


@pytest.mark.parametrize("kind", FACTORIES)
def test_negative_step_is_a_value_error(kind):
    # a fresh sampler marks "nothing drawn yet" as chunk (or epoch) -1, where step -1 used to fail on None
    sampler = FACTORIES[kind](seed=0)
    for _ in range(2):  # fresh, then after a batch
        with pytest.raises(ValueError, match="step must be >= 0, got -1"):
            sampler.batch(-1)
        sampler.batch(0)


def test_resume_rejects_other_configuration():
    state = RandomWindows(10_000, 32, 8, seed=0).state_dict()
    with pytest.raises(ValueError, match="seq_len is 32, this sampler has 64"):
        RandomWindows(10_000, 64, 8, seed=0).load_state_dict(state)


@pytest.mark.parametrize("kind", FACTORIES)
def test_ranks_are_disjoint_slices_of_the_global_stream(kind):
    make = FACTORIES[kind]
    world = 4
    single = _take(make(seed=5), 60)  # world_size 1 with the same per-rank batch
    ranks = [_take(make(seed=5, rank=r, world_size=world), 60) for r in range(world)]
    if kind == "epoch":
        # every rank's windows in one epoch, together: disjoint and covering all windows
        s = make(seed=5, world_size=world)
        per_rank = [np.concatenate([b[0] for b in r[: s.batches_per_epoch]]) for r in ranks]
        allw = np.concatenate(per_rank)
        assert len(np.unique(allw)) == len(allw) == s.n_windows  # 312 windows, divisible by 4
    else:
        for step in range(60):
            rows = [r[step][0] for r in ranks]
            assert len({r[step][1] for r in ranks}) == 1  # same length on every rank
            merged = np.empty(sum(len(x) for x in rows), dtype=np.int64)
            for i, x in enumerate(rows):
                merged[i::world] = x
            assert len(merged) == world * len(single[step][0])
            # different ranks got different sample slots; with 10k positions collisions are rare, not impossible
            assert len(np.unique(merged)) >= len(merged) - 2


def test_epoch_covers_every_token_once():
    n_tokens, seq_len = 10_001, 50  # 200 windows of 50 inputs: tokens 0..9999 are inputs exactly once
    s = EpochWindows(n_tokens, seq_len, 7, seed=0)
    counts = np.zeros(n_tokens, dtype=int)
    for starts, t in _take(s, s.batches_per_epoch):
        for st in starts:
            counts[st : st + t] += 1
    assert (counts[:10_000] == 1).all() and counts[10_000] == 0
    assert s.epoch_of(s.batches_per_epoch) == 1
    e0 = np.concatenate([b for b, _ in _take(EpochWindows(n_tokens, seq_len, 7, seed=0), s.batches_per_epoch)])
    e1 = np.concatenate([b for b, _ in _take(s, s.batches_per_epoch)])  # continues into epoch 1
    assert sorted(e0) == sorted(e1) and not np.array_equal(e0, e1)  # same windows, new order


def test_random_windows_stay_in_bounds_and_reach_the_end():
    s = RandomWindows(100, 10, 64, seed=0)
    starts = np.concatenate([b for b, _ in _take(s, 100)])
    assert starts.min() == 0 and starts.max() == 100 - 11  # the last window ends exactly at the file's end


def test_warmup_schedule_keeps_tokens_per_batch_constant():
    sched = SeqLenWarmup(64, 1024, 100)
    assert [sched(s) for s in (0, 25, 50, 75, 100, 10_000)] == [64, 128, 256, 512, 1024, 1024]
    s = DynamicLength(1_000_000, 16384, sched, seed=0)
    for starts, t in _take(s, 120):
        assert len(starts) * t == 16384
    with pytest.raises(ValueError, match="power of two"):
        SeqLenWarmup(96, 1024, 10)


def test_schedule_that_does_not_divide_is_an_error():
    s = DynamicLength(10_000, 1000, lambda step: 300, seed=0)
    with pytest.raises(ValueError, match="step 0: seq_len 300 does not divide tokens_per_batch 1000"):
        s.batch(0)


def test_document_lengths_pick_the_bucket_of_the_drawn_document():
    lengths = np.array([100] * 50 + [900] * 50)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    s = DynamicLength(int(offsets[-1]), 4096, DocumentLengths(offsets, (256, 1024)), seed=0)
    seen = set()
    for starts, t in _take(s, 100):
        assert len(starts) * t == 4096
        last = offsets[-1] - t - 1  # a window that would run past the end is moved back to fit
        assert (np.isin(starts, offsets[:-1]) | (starts == last)).all()  # windows start at documents
        anchor_len = lengths[np.searchsorted(offsets, starts[0])]
        assert t == (256 if anchor_len <= 256 else 1024)
        seen.add(t)
    assert seen == {256, 1024}


def test_blend_ranks_take_interleaved_rows_of_the_single_process_stream():
    # rank r of W takes rows r, r+W, ... of the batch a single process with a W-times larger batch would draw:
    # the ranks' sample slots are disjoint and together are exactly that stream
    world = 3
    single = _take(BlendWindows([6_000, 3_000, 1_000], [0.7, 0.2, 0.1], 32, 8 * world, seed=5), 130)
    ranks = [
        _take(BlendWindows([6_000, 3_000, 1_000], [0.7, 0.2, 0.1], 32, 8, seed=5, rank=r, world_size=world), 130)
        for r in range(world)
    ]
    for step, (starts, t) in enumerate(single):
        for r in range(world):
            assert ranks[r][step][1] == t and np.array_equal(ranks[r][step][0], starts[r::world])


def test_blend_windows_stay_inside_their_source_and_reach_its_end():
    sizes, seq_len = [100, 50, 40], 9
    offsets = np.cumsum([0, *sizes])
    starts = np.concatenate([b for b, _ in _take(BlendWindows(sizes, [1, 1, 1], seq_len, 64, seed=0), 100)])
    source = np.searchsorted(offsets, starts, side="right") - 1
    assert (starts + seq_len + 1 <= offsets[source + 1]).all()  # every window of T + 1 tokens inside one source
    for i in range(3):  # first and last possible start of each source drawn
        mine = starts[source == i]
        assert mine.min() == offsets[i] and mine.max() == offsets[i + 1] - seq_len - 1


def test_blend_zero_weight_source_is_never_drawn():
    starts = np.concatenate([b for b, _ in _take(BlendWindows([100, 100, 100], [1, 0, 2], 8, 64, seed=0), 50)])
    assert not ((starts >= 100) & (starts < 200)).any()


@pytest.mark.parametrize(
    ("sizes", "weights", "match"),
    [
        ([100, 100], [1, -1], r"weights\[1\] must be a finite number >= 0, got -1"),
        ([100, 100], [0, 0], "weights must not all be 0"),
        ([100, 100], [1, float("nan")], r"weights\[1\] must be a finite number"),
        ([100], [1, 1], "one weight per source"),
        ([100, 5], [1, 1], r"source 1 has 5 tokens, fewer than a window of seq_len \+ 1 \(9\)"),
    ],
)
def test_blend_windows_reject_bad_configuration(sizes, weights, match):
    with pytest.raises(ValueError, match=match):
        BlendWindows(sizes, weights, 8, 4, seed=0)


def test_blend_state_round_trips_through_json_and_rejects_other_weights():
    s = BlendWindows([6_000, 3_000], [0.7, 0.3], 32, 8, seed=1)
    _take(s, 5)
    state = json.loads(json.dumps(s.state_dict()))
    same = BlendWindows([6_000, 3_000], [0.7, 0.3], 32, 8, seed=1)
    same.load_state_dict(state)
    assert same.step == 5
    with pytest.raises(ValueError, match=r"weights is \[0.7, 0.3\], this sampler has \[0.5, 0.5\]"):
        BlendWindows([6_000, 3_000], [0.5, 0.5], 32, 8, seed=1).load_state_dict(state)


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_epoch_windows_resplit_to_another_world_size_reads_each_window_once(new_world):
    n_windows, seq, batch = 24, 4, 2
    n_tokens = n_windows * seq + 1
    old = [EpochWindows(n_tokens, seq, batch, seed=3, rank=r, world_size=2) for r in range(2)]
    seen = [w for s in old for _ in range(3) for w in (next(iter(s))[0] // seq).tolist()]  # 3 steps on each rank
    state = old[0].state_dict()
    assert state["step"] == 3
    new = [EpochWindows(n_tokens, seq, batch, seed=3, rank=r, world_size=new_world) for r in range(new_world)]
    for s in new:
        s.load_state_dict(json.loads(json.dumps(state)))
        assert s.step == 3 and s.resumed == (0, 12, 3)
    while new[0].epoch_of(new[0].step) == 0:
        for s in new:
            starts, _ = next(iter(s))
            seen += (starts // seq).tolist()
    padding = -(12 % -new_world)  # the rest (12 windows) is padded to a multiple of the new world size
    assert sorted(set(seen)) == list(range(n_windows)) and len(seen) == n_windows + padding
    # Later epochs follow the new layout: the next epoch is the new world's usual split of a fresh permutation.
    fresh = [EpochWindows(n_tokens, seq, batch, seed=3, rank=r, world_size=new_world) for r in range(new_world)]
    for s, f in zip(new, fresh, strict=True):
        e0 = s.step
        epoch1 = [f.batch(k)[0].tolist() for k in range(f.batches_per_epoch, 2 * f.batches_per_epoch)]
        assert [s.batch(e0 + k)[0].tolist() for k in range(f.batches_per_epoch)] == epoch1
    # A state saved after the re-split resumes it (same world size) and re-splits again (another one).
    again = EpochWindows(n_tokens, seq, batch, seed=3, rank=0, world_size=new_world)
    again.load_state_dict(new[0].state_dict())
    assert again.resumed == new[0].resumed
    assert again.batch(again.step)[0].tolist() == new[0].batch(new[0].step)[0].tolist()


def test_random_windows_resplit_keeps_the_step_and_takes_the_new_share():
    a = RandomWindows(1000, 8, 4, seed=1, rank=1, world_size=2)
    a.step = 70
    b = RandomWindows(1000, 8, 4, seed=1, rank=0, world_size=1)
    b.load_state_dict(a.state_dict())
    assert b.step == 70 and b.batch(70)[0].shape == (4,)
    with pytest.raises(ValueError, match="seed is 1, this sampler has 2"):
        RandomWindows(1000, 8, 4, seed=2).load_state_dict(a.state_dict())


TOO_SHORT = [
    # (id, a sampler over data shorter than its windows): one line naming the token count and seq_len, and what fits
    ("random, 88 tokens", lambda: RandomWindows(88, 128, 4, seed=0),
     r"the data has 88 tokens, fewer than one window at seq_len 128 \(129 tokens with the last target\): use more "
     "text, or a seq_len of at most 87$"),
    ("random, exactly seq_len", lambda: RandomWindows(128, 128, 4, seed=0), "the data has 128 tokens, fewer than"),
    ("random, one token", lambda: RandomWindows(1, 128, 4, seed=0), "the data has 1 tokens, .*: use more text$"),
    ("epoch, 88 tokens", lambda: EpochWindows(88, 128, 4, seed=0),
     "the data has 88 tokens, 0 windows at seq_len 128, fewer than world_size 1: use more text, or a seq_len of "
     "at most 87"),
    ("epoch, 2 ranks", lambda: EpochWindows(200, 128, 4, seed=0, world_size=2),
     "the data has 200 tokens, 1 windows at seq_len 128, fewer than world_size 2: .* a seq_len of at most 99"),
    ("dynamic", lambda: DynamicLength(88, 256, 128, seed=0).batch(0),
     r"the data has 88 tokens, fewer than one window at seq_len 128 \(129 tokens\) at step 0: .* at most 87"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "message"), [c[1:] for c in TOO_SHORT], ids=[c[0] for c in TOO_SHORT])
def test_data_shorter_than_a_window_is_one_line(make, message):
    with pytest.raises(ValueError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


def test_a_window_that_just_fits_is_accepted():
    assert RandomWindows(129, 128, 4, seed=0).batch(0)[0].tolist() == [0, 0, 0, 0]
    assert EpochWindows(129, 128, 4, seed=0).n_windows == 1


def _global_rows(samplers, steps):
    """The global batches the ranks draw at `steps`, rows in stream order (rank r holds rows r, r + W, ...)."""
    world = len(samplers)
    out = []
    for step in steps:
        parts = [s.batch(step)[0] for s in samplers]
        rows = np.empty(sum(len(p) for p in parts), dtype=np.int64)
        for r, part in enumerate(parts):
            rows[r::world] = part
        out.append(rows)
    return np.concatenate(out)


def _random_windows(rank, world):
    return RandomWindows(50_000, 8, 4, seed=3, rank=rank, world_size=world)


def _blend_windows(rank, world):
    return BlendWindows([30_000, 15_000, 5_000], [0.7, 0.2, 0.1], 8, 4, seed=3, rank=rank, world_size=world)


@pytest.mark.parametrize("fault", [None, "width_ignored"])
@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("make", [_random_windows, _blend_windows], ids=["random", "blend"])
def test_random_samplers_resplit_to_another_width_continue_the_stream(monkeypatch, make, old_world, new_world, fault):
    # lmtrain keeps the global batch on a resume to another world size by changing the accumulation, so the
    # sampler's global width (batch_size x world_size) changes: 2 ranks x 4 rows, then 1 rank x 4 rows twice a step.
    # The rows after the resume must be the rows an uninterrupted run draws next, none the run has already read.
    if fault == "width_ignored":  # the earlier re-split: the step kept, the stream re-cut to the new width
        monkeypatch.setattr(type(make(0, 1)), "_reshard", lambda self, state: None)
    done = 100  # 100 steps: the stream crosses a 64-step chunk of the old width
    old = [make(r, old_world) for r in range(old_world)]
    read = _global_rows(old, range(done))
    stream = _global_rows(old, range(done + 200))[len(read) :]  # what the old world would draw next
    state = json.loads(json.dumps({**old[0].state_dict(), "step": done}))
    new = [make(r, new_world) for r in range(new_world)]
    for s in new:
        s.load_state_dict(state)
    after = _global_rows(new, range(done, done + 60))
    again = make(0, new_world)  # resumed once more, on the same world
    again.load_state_dict(json.loads(json.dumps({**new[0].state_dict(), "step": done + 30})))
    if fault is None:
        assert np.array_equal(after, stream[: len(after)])
        assert np.array_equal(again.batch(done + 30)[0], new[0].batch(done + 30)[0])
    else:
        assert not np.array_equal(after, stream[: len(after)])  # what the equality above catches
