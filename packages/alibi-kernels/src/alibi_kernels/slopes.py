"""ALiBi head slopes: fixed, one geometric sequence per head count."""

from __future__ import annotations

import math

import torch

__all__ = ["alibi_slopes", "alibi_slopes_list"]


def _power_of_two_slopes(n: int) -> list[float]:
    # m_h = 2^(-8h/n), h = 1..n: a geometric sequence starting and ending at 2^(-8/n) and 2^-8.
    return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]


def alibi_slopes_list(n_heads: int) -> list[float]:
    """The ALiBi slopes for `n_heads` heads as Python floats (double precision).

    For a power of two n the slopes are 2^(-8h/n), h = 1..n. Otherwise ALiBi takes the slopes of the
    nearest lower power of two c and appends every other slope of the 2c set: slopes(2c)[0::2][: n - c].

    Example:
        >>> alibi_slopes_list(2)
        [0.0625, 0.00390625]
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    closest = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = _power_of_two_slopes(closest)
    if closest != n_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return slopes


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi slopes for `n_heads` heads: a float32 tensor of shape (n_heads,), ALiBi's rule.

    Non-powers of two follow ALiBi's rule (slopes of the nearest lower power of two c, then every other slope of
    the 2c set), not an interpolation.

    Example:
        >>> alibi_slopes(8)[:2]
        tensor([0.5000, 0.2500])
    """
    return torch.tensor(alibi_slopes_list(n_heads), dtype=torch.float32)
