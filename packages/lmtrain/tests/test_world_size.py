import pytest

from lmtrain.run_plan import keep_global_batch
from trainloop import TrainConfig


@pytest.mark.parametrize(
    "micro, accum, rows, world, fixed, expect, words",
    [
        (8, 1, 16, 1, set(), (8, 2), "grad_accum 1 -> 2 keeps the global batch of 16 rows"),
        (4, 2, 8, 2, set(), (4, 1), "grad_accum 2 -> 1"),
        (4, 1, 4, 2, set(), (2, 1), "micro_batch 4 -> 2"),  # accumulation cannot halve below 1
        (4, 1, 4, 2, {"micro_batch"}, (4, 1), "changes from 4 to 8 rows"),  # the user's micro batch is kept
        (3, 1, 3, 2, set(), (3, 1), "does not split over 2 ranks"),
        # A DeepSpeed JSON with train_batch_size already derived the batch for the new world size: nothing to do.
        (2, 4, 128, 16, {"micro_batch", "grad_accum"}, (2, 4), "stays 128 rows"),
    ],
)
def test_keep_global_batch(micro, accum, rows, world, fixed, expect, words):
    cfg, note = keep_global_batch(TrainConfig(micro_batch=micro, grad_accum=accum), rows, world, fixed)
    assert (cfg.micro_batch, cfg.grad_accum) == expect and words in note
