"""WikiText-2 benchmark: `lmtrain` defaults under a time budget against a word-level 2-layer LSTM, both scored by
word-level perplexity on text neither trained nor was tuned on.

    python tools/bench_wikitext.py                 # 260 s budget, LSTM reference, prints wikitext_word_ppl last
    python tools/bench_wikitext.py --skip-lstm     # only the lmtrain run

Data: WikiText-2's validation split (`../shared/data/wikitext-2/valid.txt` beside the repository; the script skips
without it). Its articles (a line ` = Title = ` starts one) are split by position: the last 10% are the report text,
used only for the figure printed here and never to choose anything; of the first 90%, every 20th article is
lmtrain's validation text (what the run evaluates and early-stops on) and the rest its training text.

The reference is this script's own LSTM (the sizes and training of pytorch/examples' word_language_model defaults:
2 layers of 200, embedding 200, dropout 0.2, SGD lr 20 divided by 4 when validation stops improving, gradient clip
0.25, 35-token BPTT windows, batch 20), trained for `--lstm-epochs` epochs on the same training text and validated on
the same validation text. A word-level model can only score words it has seen: words of the report text that its
training text lacks (7% of them) are scored as `<unk>`, an easy, frequent token (the split already maps rare words
to `<unk>`), while a subword model spells each such word out. The comparison therefore scores lmtrain's model on
the same closed-vocabulary text (those words replaced by `<unk>`), and prints beside it lmtrain's open-vocabulary
figure on the report text as it is (`wikitext_word_ppl:`, the figure a WikiText-2 perplexity usually means for a
subword model). Word counts are whitespace-separated words plus one end-of-line per line in both, so the
perplexities divide the same total by the same number of words.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
TITLE = re.compile(r"^ = [^=].* = $")


def split_articles(text: str) -> list[str]:
    """The split's articles, each starting at its ` = Title = ` line (text before the first title is dropped)."""
    articles: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if TITLE.match(line.rstrip("\n")):
            articles.append([])
        if articles:
            articles[-1].append(line)
    return ["".join(a) for a in articles]


def make_splits(work: Path) -> dict[str, Path]:
    articles = split_articles(DATA.read_text(encoding="utf-8"))
    n_report = math.ceil(0.1 * len(articles))
    tuning, report = articles[:-n_report], articles[-n_report:]
    parts = {
        "train": [a for i, a in enumerate(tuning) if i % 20 != 19],
        "val": [a for i, a in enumerate(tuning) if i % 20 == 19],
        "report": report,
    }
    paths = {}
    for name, docs in parts.items():
        paths[name] = work / f"{name}.txt"
        paths[name].write_text("".join(docs), encoding="utf-8")
        print(f"{name}: {len(docs)} articles, {paths[name].stat().st_size:,} bytes")
    return paths


def lmtrain(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmtrain", *args]
    print("$ " + " ".join(cmd[2:]), flush=True)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"lmtrain {args[0]} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr}")
    return result


def run_lmtrain(paths: dict[str, Path], work: Path, budget: float, settings: list[str]) -> dict:
    data, run = work / "data", work / "run"
    lmtrain("prepare", "--text", str(paths["train"]), "--val-text", str(paths["val"]), "--out", str(data))
    t0 = time.perf_counter()
    overrides = [a for kv in settings for a in ("--set", kv)]
    train = lmtrain("train", "--data", str(data), "--out", str(run), "--time-budget", str(budget), "--json", *overrides)
    wall = time.perf_counter() - t0
    summary = json.loads(train.stdout.strip().splitlines()[-1])["summary"]
    ev, closed = (
        json.loads(lmtrain("eval", "--run", str(run), "--text", str(text), "--json").stdout.strip().splitlines()[-1])
        for text in (paths["report"], paths["report_closed"])
    )
    info = json.loads((run / "run.json").read_text())
    return {"eval": ev, "closed": closed, "summary": summary, "wall_s": wall, "run": info}


# ------------------------------------------------------------------------------------------------ LSTM reference
def words_of(path: Path) -> list[str]:
    out: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        out += line.split() + ["<eos>"]
    return out


def closed_vocabulary(text: Path, train: Path, out: Path) -> Path:
    r"""`text` with every word that `train` never contains replaced by `<unk>`: the text a word-level model with
    `train`'s vocabulary scores. Spacing and line breaks are kept, so the word count is unchanged.

    Example:
        >>> import tempfile; d = Path(tempfile.mkdtemp())
        >>> _ = (d / "t.txt").write_text("the cat sat\n"); _ = (d / "x.txt").write_text(" the dog sat \n")
        >>> closed_vocabulary(d / "x.txt", d / "t.txt", d / "o.txt").read_text()
        ' the <unk> sat \n'
    """
    known = set(words_of(train))
    pieces = re.split(r"(\s+)", text.read_text(encoding="utf-8"))
    out.write_text("".join(p if not p or p.isspace() or p in known else "<unk>" for p in pieces), encoding="utf-8")
    return out


def run_lstm(paths: dict[str, Path], epochs: int, seed: int = 1111) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    train_words = words_of(paths["train"])
    vocab = {w: i for i, w in enumerate(sorted(set(train_words) | {"<unk>"}))}

    def ids(words: list[str]) -> torch.Tensor:
        return torch.tensor([vocab.get(w, vocab["<unk>"]) for w in words], dtype=torch.long)

    def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
        n = data.numel() // bsz
        return data[: n * bsz].view(bsz, n).t().contiguous()  # (n, bsz)

    class LSTMLM(nn.Module):
        def __init__(self, ntoken: int, ninp: int = 200, nhid: int = 200, nlayers: int = 2, dropout: float = 0.2):
            super().__init__()
            self.drop = nn.Dropout(dropout)
            self.encoder = nn.Embedding(ntoken, ninp)
            self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
            self.decoder = nn.Linear(nhid, ntoken)
            nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
            nn.init.zeros_(self.decoder.bias)

        def forward(self, x: torch.Tensor, hidden: tuple) -> tuple[torch.Tensor, tuple]:
            out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)  # (T, B, nhid)
            return self.decoder(self.drop(out)), hidden  # (T, B, V)

    model = LSTMLM(len(vocab))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    bptt, lr = 35, 20.0

    def hidden0(bsz: int) -> tuple:
        return (torch.zeros(2, bsz, 200), torch.zeros(2, bsz, 200))

    def nll(data: torch.Tensor, bsz: int) -> tuple[float, int]:
        model.eval()
        total, count, hidden = 0.0, 0, hidden0(bsz)
        with torch.no_grad():
            for i in range(0, data.size(0) - 1, bptt):
                x, y = (
                    data[i : i + min(bptt, data.size(0) - 1 - i)],
                    data[i + 1 : i + 1 + min(bptt, data.size(0) - 1 - i)],
                )
                out, hidden = model(x, hidden)
                total += float(loss_fn(out.view(-1, out.size(-1)), y.reshape(-1)))
                count += y.numel()
        return total, count

    train = batchify(ids(train_words), 20)
    val = batchify(ids(words_of(paths["val"])), 10)
    best_val, t0 = float("inf"), time.perf_counter()
    for epoch in range(epochs):
        model.train()
        hidden = hidden0(20)
        for i in range(0, train.size(0) - 1, bptt):
            seq = min(bptt, train.size(0) - 1 - i)
            x, y = train[i : i + seq], train[i + 1 : i + 1 + seq]
            hidden = tuple(h.detach() for h in hidden)
            model.zero_grad()
            out, hidden = model(x, hidden)
            (loss_fn(out.view(-1, out.size(-1)), y.reshape(-1)) / y.numel()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
        total, count = nll(val, 10)
        val_loss = total / count
        print(
            f"lstm epoch {epoch + 1}: val ppl {math.exp(val_loss):.1f} ({time.perf_counter() - t0:.0f} s)", flush=True
        )
        if val_loss < best_val:
            best_val = val_loss
            best = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            lr /= 4.0
    model.load_state_dict(best)
    report = ids(words_of(paths["report"])).view(-1, 1)  # one stream: every word after the first is scored
    total, count = nll(report, 1)
    return {"word_ppl": math.exp(total / count), "words_scored": count, "train_s": time.perf_counter() - t0,
            "vocab": len(vocab)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=260.0, help="lmtrain train --time-budget (default 260)")
    parser.add_argument("--lstm-epochs", type=int, default=2, help="epochs of the LSTM reference (default 2)")
    parser.add_argument("--skip-lstm", action="store_true", help="run only lmtrain")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to lmtrain train")
    parser.add_argument("--work", default=None, help="keep the data and run here (default: a temporary directory)")
    args = parser.parse_args()
    if not DATA.is_file():
        print(f"skipped: {DATA} is absent (expected ../shared/data next to the repository root)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = make_splits(work)
        paths["report_closed"] = closed_vocabulary(paths["report"], paths["train"], work / "report.closed.txt")
        print(f"load average at the start (2 cores): {os.getloadavg()[0]:.1f}")
        ours = run_lmtrain(paths, work, args.budget, args.set)
        ev, closed, summary = ours["eval"], ours["closed"], ours["summary"]
        print(f"lmtrain: {summary['step']} steps ({summary['stopped'] or 'planned end'}; best at step "
              f"{(summary.get('best') or {}).get('step')}), {summary['tokens_seen']:,} tokens, train command "
              f"{ours['wall_s']:.0f} s, plan: {ours['run'].get('plan', {}).get('note', 'none')}")  # fmt: skip
        print(f"lmtrain on the report text: {ev['words']:,} words, word ppl {ev['word_ppl']:.1f}, "
              f"{ev['bits_per_byte']:.4f} bits/byte (checkpoint {ev.get('checkpoint', '?')})")  # fmt: skip
        print(f"lmtrain on the report text, closed vocabulary (words absent from the training text as <unk>, "
              f"as the LSTM scores them): word ppl {closed['word_ppl']:.1f}")  # fmt: skip
        if not args.skip_lstm:
            lstm = run_lstm(paths, args.lstm_epochs)
            print(
                f"lstm reference on the report text, closed vocabulary: word ppl {lstm['word_ppl']:.1f} "
                f"({lstm['words_scored']:,} words scored, vocab {lstm['vocab']:,}, {lstm['train_s']:.0f} s)"
            )
            print(f"lmtrain_vs_lstm_word_ppl: {closed['word_ppl'] / lstm['word_ppl']:.3f} (same closed-vocabulary "
                  f"text; goal <= 0.75)")  # fmt: skip
        print(f"load average at the end (2 cores): {os.getloadavg()[0]:.1f}")
        print(f"wikitext_word_ppl: {ev['word_ppl']:.1f} (open vocabulary: every word of the report text spelled out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
