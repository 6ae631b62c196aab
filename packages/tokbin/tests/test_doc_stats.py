"""`tokbin stats`: the document-length distribution of a token file, as the dynamic-length sampler sees it."""

from __future__ import annotations

import numpy as np

from tokbin import write_tokens
from tokbin.cli import main
from tokbin.doc_stats import document_length_stats


def test_lengths_percentiles_and_bucket_shares():
    lengths = np.array([10] * 90 + [500] * 9 + [3000])
    stats = document_length_stats(np.concatenate([[0], np.cumsum(lengths)]), buckets=(256, 1024))
    assert (stats["documents"], stats["tokens"], stats["min"], stats["max"]) == (100, 8400, 10, 3000)
    assert stats["median"] == 10 and stats["p99"] > 500
    assert stats["buckets"]["256"] == {"documents": 0.9, "tokens": 900 / 8400}
    assert stats["buckets"]["1024"]["documents"] == 0.99


def test_cli_prints_the_distribution(tmp_path, capsys):
    docs = [np.full(n, 3) for n in (5, 10, 25)]
    path = write_tokens(tmp_path / "t.bin", docs, vocab_size=16).path
    assert main(["stats", str(path), "--buckets", "8", "16"]) == 0
    out = capsys.readouterr().out
    assert "documents 3, tokens 40" in out and "length: min 5" in out and "max 25" in out
    assert "<=      8 tokens:  33.3% of documents,  12.5% of tokens" in out
