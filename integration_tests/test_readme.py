"""The README's "First hour" commands, run as written in a fresh directory with a fresh HOME (after the session
installed the packages by the README's own install line), and the follow-up commands `lmtrain demo` prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the First hour exports to transformers: its hf extra needs "
                    "transformers 5.24+, released for Python 3.11 and later")  # fmt: skip
def test_the_first_hour_runs_as_written(tmp_path):
    env = child_env()
    env.pop("TQDM_DISABLE")  # as a user has it; the output is not a terminal, so progress comes as lines
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `lmtrain` and `python3` of this environment
    command = [sys.executable, str(ROOT / "tools" / "check_install_docs.py"), "--run", "First hour", "--workdir",
               str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-3000:]
    assert "all 2 blocks of '## First hour' ran as written" in out
    # The demo shows what it learned, and says how to reach the commands it prints next.
    assert "bits per byte after training" in out and "before:\nclass Point:" in out
    follow = [line.strip() for line in out[out.index("next:\n") :].splitlines()[1:4]]
    assert all(" --run " in line for line in follow), out[-3000:]
    generate = subprocess.run(follow[0], shell=True, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)  # fmt: skip
    assert generate.returncode == 0 and generate.stdout.startswith("def main():"), generate.stderr[-2000:]
    # The export said which layout it wrote; the run ended with its closing block.
    assert "lmtrain export: wrote " in out and "lmtrain: run finished" in out
    assert (tmp_path / "runs" / "mine" / "loss.png").is_file() and (tmp_path / "run.toml").is_file()


def test_the_runner_runs_each_block_and_stops_at_a_failing_command(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import check_install_docs

    doc = tmp_path / "README.md"
    doc.write_text(
        "## Other\n```bash\nexit 1\n```\n## First hour\n```bash\npip install nothing-at-all\necho one > one.txt\n```\n"
        "text\n```bash\ncat one.txt > two.txt\nfalse\necho never > three.txt\n```\n"
    )
    monkeypatch.setattr(check_install_docs, "ROOT", tmp_path)
    blocks = [b.splitlines() for b in check_install_docs.section_blocks(doc, "First hour")]
    assert blocks == [["pip install nothing-at-all", "echo one > one.txt"],
                      ["cat one.txt > two.txt", "false", "echo never > three.txt"]]  # fmt: skip
    assert check_install_docs.run_section(doc, "First hour", tmp_path / "work") == 1
    work = tmp_path / "work"
    assert (work / "two.txt").read_text() == "one\n" and not (work / "three.txt").exists()  # -e: stops at `false`
