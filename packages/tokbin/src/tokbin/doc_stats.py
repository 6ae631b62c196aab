"""The document-length distribution of a token file: what the dynamic-length sampler (``DynamicLength`` with
``DocumentLengths``) is tuned from. `tokbin stats FILE` prints it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)


def document_length_stats(doc_offsets: Any, buckets: Sequence[int] = (256, 1024)) -> dict[str, Any]:
    """Counts, mean, percentiles and extremes of the document lengths in tokens (EOS included), and for each bucket
    the share of documents and of tokens in documents that fit it (length <= bucket): what a ``DocumentLengths``
    sampler with those buckets would draw.

    Example:
        >>> stats = document_length_stats(np.array([0, 100, 400, 2400]), buckets=(256, 1024))
        >>> stats["documents"], stats["median"], stats["max"], stats["buckets"]["256"]["documents"]
        (3, 300.0, 2000, 0.3333333333333333)
    """
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1]
    if bad:
        raise ValueError(f"buckets: expected lengths in tokens >= 1, got {bad[0]!r}; e.g. --buckets 256 1024")
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 2:
        raise ValueError("doc_offsets must hold at least one document (2 offsets)")
    lengths = np.diff(offsets)
    total = int(lengths.sum())
    out: dict[str, Any] = {"documents": int(len(lengths)), "tokens": total, "mean": float(lengths.mean()),
                           "min": int(lengths.min()), "max": int(lengths.max())}  # fmt: skip
    for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["median"] = out["p50"]
    out["buckets"] = {
        str(b): {
            "documents": float((lengths <= b).mean()),
            "tokens": float(lengths[lengths <= b].sum() / max(1, total)),
        }
        for b in sorted(buckets)
    }
    return out


def format_stats(stats: dict[str, Any]) -> list[str]:
    """The lines `tokbin stats` prints."""
    pct = ", ".join(f"p{p} {stats[f'p{p}']:,.0f}" for p in PERCENTILES)
    lines = [
        f"documents {stats['documents']:,}, tokens {stats['tokens']:,}, mean length {stats['mean']:,.1f}",
        f"length: min {stats['min']:,}, {pct}, max {stats['max']:,}",
    ]
    for b, share in stats["buckets"].items():
        lines.append(
            f"<= {int(b):>6,} tokens: {share['documents']:6.1%} of documents, {share['tokens']:6.1%} of tokens"
        )
    return lines
