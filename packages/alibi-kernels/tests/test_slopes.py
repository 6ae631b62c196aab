import math

import pytest
import torch

from alibi_kernels import alibi_slopes, alibi_slopes_list


def paper_rule(n: int) -> list[float]:
    """The ALiBi paper's rule, written independently of the package: for n a power of two the geometric sequence
    starting at 2^(-8/n) with that ratio; otherwise the sequence of the largest power of two c below n, followed by
    every other slope of the 2c sequence, first n - c of them."""

    def pow2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))  # the paper's code: start = 2^(-8/m), ratio = start
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + pow2(2 * c)[0::2][: n - c]


@pytest.mark.parametrize("n", range(1, 65))
def test_slopes_follow_the_paper_rule(n):
    got = alibi_slopes(n)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.allclose(got.double(), torch.tensor(paper_rule(n), dtype=torch.float64), rtol=1e-6, atol=0)


def test_known_values():
    assert alibi_slopes_list(8) == [2.0**-i for i in range(1, 9)]
    # 12 heads: the 8 slopes 2^-1..2^-8, then every other slope of the 16 set: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
    assert alibi_slopes_list(12)[8:] == pytest.approx([2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5])
    assert len(set(alibi_slopes_list(12))) == 12


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_slopes_reject_bad_head_counts(bad):
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(bad)
