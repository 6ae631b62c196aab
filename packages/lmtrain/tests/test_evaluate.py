import math

import pytest
import torch

from lmtrain.errors import LmtrainError
from lmtrain.evaluate import metrics_from_nll, sliding_window_nll, text_stats, window_plan


@pytest.mark.parametrize("n,context,stride,offset", [(10, 4, 2, 0), (100, 16, 5, 3), (7, 32, 16, 0), (50, 8, 8, 7)])
def test_window_plan_scores_every_target_once(n, context, stride, offset):
    scored = []
    for start, end, first in window_plan(n, context, stride, offset):
        assert end - start <= context and start <= first < end
        scored.extend(range(first, end))
    assert scored == list(range(n))


def test_window_plan_rejects_stride_above_context():
    with pytest.raises(LmtrainError, match="stride"):
        window_plan(10, 4, 5)


class Bigram(torch.nn.Module):
    """Logits depend only on the current token, so the sliding-window NLL must equal the full-sequence one."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, ids):
        from lmcore import LMOutput

        return LMOutput(self.table[ids], None)


def test_sliding_window_nll_matches_direct_sum():
    torch.manual_seed(0)
    model = Bigram(11)
    tokens = torch.randint(0, 11, (57,))
    with torch.no_grad():
        direct = torch.nn.functional.cross_entropy(model.table[tokens[:-1]], tokens[1:], reduction="sum")
    for context, stride in ((8, 4), (16, 16), (100, 50)):
        nll, n = sliding_window_nll(model, tokens, context, stride, batch_size=3)
        assert n == 56
        assert math.isclose(nll, float(direct), rel_tol=1e-5)


def test_metrics_from_nll():
    stats = text_stats("to be\nor not\n")
    assert stats == {"bytes": 13, "words": 6}
    m = metrics_from_nll(nll=10.0, tokens=5, stats=stats)
    assert math.isclose(m["loss"], 2.0) and math.isclose(m["token_ppl"], math.exp(2.0))
    assert math.isclose(m["bits_per_byte"], 10.0 / math.log(2) / 13)
    assert math.isclose(m["word_ppl"], math.exp(10.0 / 6))
