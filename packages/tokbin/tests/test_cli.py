import json
import subprocess
import sys

import numpy as np
import pytest

from tokbin import TokenFile, write_tokens
from tokbin.cli import main


def test_train_encode_info_verify(tmp_path, corpus, wiki_text, capsys):
    prefix = tmp_path / "spm"
    args = ["train-tokenizer", "--input", str(corpus), "--model-prefix", str(prefix), "--vocab-size", "400"]
    assert main([*args, "--byte-fallback", "--quiet", "--user-defined-symbols", "<|end|>"]) == 0
    model = tmp_path / "spm.model"
    assert model.is_file()
    out = tmp_path / "o.bin"
    enc = ["encode", "--tokenizer", str(model), "--input", str(corpus), str(wiki_text), "--output", str(out)]
    assert main([*enc, "--workers", "2", "--split-docs", "--quiet"]) == 0
    assert TokenFile(out).n_docs > 2
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocab_size"] == 400 and info["dtype"] == "uint16" and info["n_tokens"] == TokenFile(out).n_tokens
    assert main(["verify", str(out), "--tokenizer", str(model), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out


def test_errors_are_one_line_with_nonzero_exit(tmp_path, lossless_model, other_model, corpus, capsys):
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x00" * 300)
    assert main(["info", str(foreign)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(foreign) in err and "not a tokbin file: expected magic" in err

    good = tmp_path / "good.bin"
    assert main(["encode", "--tokenizer", str(lossless_model), "--input", str(corpus), "--output", str(good)]) == 0
    capsys.readouterr()
    assert main(["verify", str(good), "--tokenizer", str(other_model), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer mismatch" in err

    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    assert main(["encode", "--tokenizer", str(lossless_model), "--input", str(latin), "--output", str(good)]) == 2
    assert "latin.txt: not valid UTF-8 at byte 3" in capsys.readouterr().err
    assert TokenFile(good).verify()  # the failed encode did not touch the existing output


def test_console_script_exit_codes(tmp_path):
    ok = write_tokens(tmp_path / "ok.bin", np.arange(100), vocab_size=100).path
    run = [sys.executable, "-m", "tokbin.cli"]
    good = subprocess.run([*run, "verify", str(ok), "--quiet"], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    data = ok.read_bytes()
    ok.write_bytes(data[:-1])
    bad = subprocess.run([*run, "info", str(ok)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "truncated" in bad.stderr and bad.stderr.count("\n") == 1
    usage = subprocess.run([*run, "encode"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2


@pytest.mark.parametrize("cmd", ["info", "verify"])
def test_missing_file(tmp_path, cmd, capsys):
    assert main([cmd, str(tmp_path / "nope.bin")]) == 2
    assert "nope.bin: no such file" in capsys.readouterr().err


def test_train_tokenizer_failure_is_one_line(tmp_path, corpus, capsys):
    args = ["train-tokenizer", "--input", str(corpus), "--model-prefix", str(tmp_path / "big")]
    assert main([*args, "--vocab-size", "100000", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "SentencePiece training failed" in err and "Vocabulary size too high" in err
    assert not (tmp_path / "big.model").exists()


def test_train_tokenizer_progress_bar(tmp_path, corpus, capsys):
    from tokbin import train_tokenizer

    model = train_tokenizer([corpus], tmp_path / "p", 300, progress=True)
    assert model.is_file() and "train-tokenizer p:" in capsys.readouterr().err


def test_workers_beyond_the_cpus_are_capped_and_said_so(tmp_path, lossless_model, corpus, capsys, monkeypatch):
    import tokbin.encode as encode

    real, pools = encode._encoded, []

    def counted(pieces, sp, opts, dtype, workers):
        pools.append(workers)
        if workers > encode.default_workers():  # 10000 processes took longer to start than the test may run
            raise AssertionError(f"a pool of {workers} processes would start")
        return real(pieces, sp, opts, dtype, workers)

    monkeypatch.setattr(encode, "_encoded", counted)
    out = tmp_path / "o.bin"
    argv = ["encode", "--tokenizer", str(lossless_model), "--input", str(corpus), "--output", str(out), "--quiet"]
    assert main([*argv, "--workers", "10000"]) == 0
    err = capsys.readouterr().err.strip()
    cpus = encode.default_workers()
    assert err == f"tokbin encode: --workers 10000 capped at {cpus} (the CPUs this process may run on)"
    assert pools == [encode.default_workers()]
    assert main([*argv[:-2], str(tmp_path / "one.bin"), "--quiet", "--workers", "1"]) == 0
    assert TokenFile(out).data_sha256 == TokenFile(tmp_path / "one.bin").data_sha256
    assert capsys.readouterr().err == ""  # no note when nothing is capped
