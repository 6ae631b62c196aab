import itertools
import threading
import time

import numpy as np
import pytest
import torch

from tokbin import ClosableBackgroundGenerator, DynamicLength, EpochWindows, Loader, RandomWindows, write_tokens


@pytest.fixture
def token_file(tmp_path):
    rng = np.random.default_rng(0)
    return write_tokens(tmp_path / "t.bin", rng.integers(0, 50_000, size=200_000), vocab_size=50_000)


def _prefetch_threads():
    return [t for t in threading.enumerate() if isinstance(t, ClosableBackgroundGenerator) and t.is_alive()]


def test_batches_follow_the_sampler_and_shift_targets(token_file):
    ids = np.asarray(token_file.tokens)
    ref = RandomWindows(token_file.n_tokens, 128, 4, seed=9)
    with Loader(token_file, RandomWindows(token_file.n_tokens, 128, 4, seed=9)) as loader:
        for step in range(10):
            x, y = next(loader)
            starts, t = ref.batch(step)
            assert x.shape == y.shape == (4, 128) and x.dtype == y.dtype == torch.int64
            expect = np.stack([ids[s : s + t + 1] for s in starts])
            assert np.array_equal(x.numpy(), expect[:, :-1]) and np.array_equal(y.numpy(), expect[:, 1:])


def test_state_dict_counts_delivered_not_prefetched_batches(token_file):
    def make():
        return Loader(token_file, EpochWindows(token_file.n_tokens, 64, 8, seed=1), max_prefetch=3)

    with make() as reference:
        expected = [next(reference) for _ in range(12)]
    loader = make()
    for _ in range(5):
        next(loader)
    time.sleep(0.1)  # let the producer run max_prefetch batches ahead
    state = loader.state_dict()
    assert state["sampler"]["step"] == 5
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(7)]
    resumed.close()
    for (x1, y1), (x2, y2) in zip(expected[5:], got, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("bad_step", [0, 3, 4])  # the first batch, a group boundary, inside a group (3 per group)
def test_producer_exception_reaches_the_consumer(token_file, bad_step):
    class Exploding(RandomWindows):
        def batch(self, step):
            if step == bad_step:
                raise RuntimeError(f"sampler broke at step {bad_step}")
            return super().batch(step)

    ref = RandomWindows(token_file.n_tokens, 16, 2, seed=0)
    loader = Loader(token_file, Exploding(token_file.n_tokens, 16, 2, seed=0), max_prefetch=3)
    for step in range(bad_step):  # every batch drawn before the failure arrives first, intact
        x, _ = next(loader)
        assert torch.equal(x, token_file.gather(*ref.batch(step))[0])
    with pytest.raises(RuntimeError, match=f"sampler broke at step {bad_step}"):
        next(loader)
    loader.close()
    assert not _prefetch_threads()


def test_loader_groups_follow_a_sequence_length_that_changes_every_batch(token_file):
    lengths = [32, 64, 64, 128, 32, 32, 64]

    def make():
        return DynamicLength(token_file.n_tokens, 256, lambda step: lengths[step % len(lengths)], seed=4)

    ref = make()
    with Loader(token_file, make(), max_prefetch=4) as loader:
        for step in range(2 * len(lengths)):
            x, y = next(loader)
            ex, ey = token_file.gather(*ref.batch(step))
            assert x.shape == (256 // lengths[step % len(lengths)], lengths[step % len(lengths)])
            assert torch.equal(x, ex) and torch.equal(y, ey) and x.is_contiguous() and y.is_contiguous()


def test_close_stops_a_producer_blocked_on_a_full_queue(token_file):
    before = len(_prefetch_threads())
    loader = Loader(token_file, RandomWindows(token_file.n_tokens, 16, 2, seed=0), max_prefetch=2)
    next(loader)
    deadline = time.monotonic() + 10
    while not loader._bg.queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._bg.queue.full()  # the producer is now blocked in put()
    thread = loader._bg
    loader.close()
    assert not thread.is_alive() and len(_prefetch_threads()) == before


def test_background_generator_close_with_endless_producer():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    bg = ClosableBackgroundGenerator(endless(), 3)
    assert [next(bg) for _ in range(5)] == [0, 1, 2, 3, 4]
    bg.close()
    assert not bg.is_alive()
    with pytest.raises(StopIteration):
        next(bg)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
def test_grouped_hand_off_keeps_order_and_ends_after_a_partial_group(group):
    bg = ClosableBackgroundGenerator(iter(range(10)), max_prefetch=4, group=group)
    assert list(bg) == list(range(10))
    assert bg.queue.maxsize == (max(1, 4 // group) if group > 1 else 4)
    bg.join(5)
    assert not bg.is_alive()


def _breaks_at_5():
    yield from range(5)
    raise KeyError("producer broke after 5 items")


def _groups_then_breaks():
    yield [0, 1]
    yield []  # skipped
    yield [2, 3]
    yield [4]
    raise KeyError("producer broke after 5 items")


@pytest.mark.parametrize(
    ("generator", "grouped"), [(_breaks_at_5, False), (_groups_then_breaks, True)], ids=["items", "pre-grouped"]
)
def test_grouped_hand_off_delivers_items_before_the_exception(generator, grouped):
    bg = ClosableBackgroundGenerator(generator(), max_prefetch=3, group=3 if not grouped else 2, grouped=grouped)
    assert [next(bg) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="producer broke after 5 items"):
        next(bg)
    with pytest.raises(StopIteration):
        next(bg)
    bg.join(5)
    assert not bg.is_alive()


def test_grouped_close_discards_the_rest_of_a_group():
    bg = ClosableBackgroundGenerator(iter(range(100)), max_prefetch=4, group=4)
    assert next(bg) == 0  # items 1, 2, 3 of the first group are now held by the consumer side
    bg.close()
    assert not bg.is_alive()
    with pytest.raises(StopIteration):
        next(bg)


def test_invalid_group():
    with pytest.raises(ValueError, match="group must be >= 1"):
        ClosableBackgroundGenerator(iter(()), 3, group=0)


def test_loader_with_block_exits_cleanly(token_file):
    with Loader(token_file, RandomWindows(token_file.n_tokens, 16, 2, seed=0)) as loader:
        next(loader)
        thread = loader._bg
    assert not thread.is_alive()


def test_invalid_max_prefetch(token_file):
    with pytest.raises(ValueError, match="max_prefetch must be >= 1"):
        Loader(token_file, RandomWindows(token_file.n_tokens, 16, 2, seed=0), max_prefetch=0)


@pytest.mark.gpu
def test_cuda_batches_are_on_the_device(token_file):
    with Loader(token_file, RandomWindows(token_file.n_tokens, 64, 4, seed=0), device="cuda") as loader:
        x, y = next(loader)
        torch.cuda.synchronize()
    assert x.is_cuda and y.is_cuda and torch.equal(x[:, 1:].cpu(), y[:, :-1].cpu())


@pytest.mark.parametrize("max_prefetch", [1, 2, 3, 5, 9])
def test_loader_queue_holds_at_most_max_prefetch_batches(token_file, max_prefetch):
    with Loader(token_file, RandomWindows(token_file.n_tokens, 16, 2, seed=0), max_prefetch=max_prefetch) as loader:
        next(loader)
        bg = loader._bg
        assert 1 <= bg.group <= max_prefetch and bg.queue.maxsize * bg.group <= max_prefetch


def test_invalid_max_prefetch_for_the_background_generator():
    with pytest.raises(ValueError, match="max_prefetch must be >= 1"):
        ClosableBackgroundGenerator(iter(()), 0)


def test_close_ends_the_source_generator_in_the_thread():
    closed = threading.Event()

    def endless():
        try:
            yield from itertools.count()
        finally:
            closed.set()

    bg = ClosableBackgroundGenerator(endless(), max_prefetch=2, group=2)
    assert next(bg) == 0
    bg.close()
    assert closed.is_set() and not bg.is_alive()


def test_base_class_is_prefetch_generators_background_generator():
    from prefetch_generator import BackgroundGenerator

    bg = ClosableBackgroundGenerator(iter(range(3)), max_prefetch=3)
    assert isinstance(bg, BackgroundGenerator) and type(bg).run is BackgroundGenerator.run
    assert list(bg) == [0, 1, 2]


def test_a_sampler_over_more_tokens_than_the_data_is_refused(token_file):
    with pytest.raises(ValueError, match="the sampler draws windows from 200001 tokens, the data has 200000"):
        Loader(token_file, RandomWindows(token_file.n_tokens + 1, 64, 4, seed=0))
    with Loader(token_file, RandomWindows(token_file.n_tokens, 64, 4, seed=0)) as loader:
        assert next(loader)[0].shape == (4, 64)
