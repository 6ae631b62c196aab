import contextlib
import json
import math
import re

import pytest
import torch
from tiny_model import SeqData, TinyLM, eval_batches

from trainloop import (
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    latest_checkpoint,
    load_model_weights,
    plot_metrics,
)


def _cfg(**kw):
    base = dict(lr=1e-2, min_lr=1e-4, warmup_steps=2, max_steps=30, micro_batch=4, log_every=1, progress=False,
                tensorboard=False, clip=1.0)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _losses(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def test_loss_falls_and_summary(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    trainer = Trainer(model, _cfg(eval_every=10), SeqData(4), run_dir=tmp_path, eval_data=lambda: eval_batches(),
                      bytes_per_token=1.0)  # fmt: skip
    out = trainer.fit()
    losses = [loss for _, loss in _losses(tmp_path)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert out["step"] == 30 and out["eval"]["ppl"] == pytest.approx(math.exp(out["eval"]["loss"]))
    assert out["eval"]["bpb"] == pytest.approx(out["eval"]["loss"] / math.log(2))
    assert model.training  # evaluation restored train mode
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes", "grad_norm/default"):
        assert key in rec, key
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_00000030"
    weights = load_model_weights(ckpt)
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k
    tied = TinyLM(tied=True)
    Trainer(tied, _cfg(max_steps=1), SeqData(4), run_dir=tmp_path / "tied").fit()
    TinyLM(tied=True).load_state_dict(load_model_weights(latest_checkpoint(tmp_path / "tied")))
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "m.png")
    assert png.stat().st_size > 1000


def _run(run_dir, max_steps, resume, dropout=0.0, **kw):
    torch.manual_seed(0)
    cfg = _cfg(max_steps=max_steps, t_max=12, save_every=3, keep_last=2, **kw)
    return Trainer(TinyLM(dropout=dropout), cfg, SeqData(4), run_dir=run_dir).fit(resume=resume)


def test_bit_exact_resume_fp32(tmp_path):
    _run(tmp_path / "a", 12, False, grad_accum=2)
    _run(tmp_path / "b", 7, False, grad_accum=2)
    _run(tmp_path / "b", 12, True, grad_accum=2)
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [s for s, _ in b] == list(range(1, 13))
    assert a == b  # bit for bit: same floats
    wa = load_model_weights(latest_checkpoint(tmp_path / "a"))
    wb = load_model_weights(latest_checkpoint(tmp_path / "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    kept = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert kept == ["step_00000009", "step_00000012"]  # keep_last=2


@pytest.mark.parametrize("fault", [None, "rng_not_restored"])
def test_bit_exact_resume_with_dropout(tmp_path, monkeypatch, fault):
    """Dropout 0.1 (what the budget planner turns on) draws from the RNG at every step, so only a resume that
    restores the RNG states repeats the uninterrupted run; with the restore skipped the same check must fail."""
    if fault == "rng_not_restored":
        monkeypatch.setattr("trainloop.trainer.set_rng_state", lambda state: None)
    _run(tmp_path / "a", 12, False, dropout=0.1)
    _run(tmp_path / "b", 7, False, dropout=0.1)  # checkpoint at step 6, then steps 7 lost
    _run(tmp_path / "b", 12, True, dropout=0.1)
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [s for s, _ in b] == list(range(1, 13))
    assert a[:6] == b[:6]
    if fault is None:
        assert a == b  # bit for bit, dropout masks included
    else:
        assert a[6:] != b[6:]  # other masks after the resume: the equality above is what catches a lost RNG


def test_resume_skips_incomplete_checkpoint(tmp_path, capsys):
    _run(tmp_path, 6, False)
    newest = tmp_path / "checkpoints" / "step_00000006"
    (newest / "manifest.json").unlink()  # as if the save had been killed before the manifest
    t = Trainer(TinyLM(), _cfg(max_steps=6, t_max=12), SeqData(4), run_dir=tmp_path)
    t.fit(resume=True)
    assert [p.name for p, _ in t.skipped_checkpoints] == ["step_00000006"]
    assert "skipping incomplete checkpoint step_00000006" in capsys.readouterr().out


class NaNAfter(TinyLM):
    def __init__(self, start: int) -> None:
        super().__init__()
        self.calls, self.start = 0, start

    def forward(self, inputs, targets):
        self.calls += 1
        loss = super().forward(inputs, targets)
        return loss * float("nan") if self.calls > self.start else loss


def test_nan_steps_are_skipped_then_stop(tmp_path):
    torch.manual_seed(0)
    model = NaNAfter(start=3)
    trainer = Trainer(model, _cfg(max_consecutive_skips=3), SeqData(4), run_dir=tmp_path)
    with pytest.raises(NonFiniteLossError, match="lower lr"):
        trainer.fit()
    recs = _losses(tmp_path)
    assert [s for s, _ in recs] == [1, 2, 3, 4, 5, 6]
    assert all(math.isnan(loss) if loss is not None else True for _, loss in recs[3:])
    # Skipped steps leave weights and optimizer untouched: weights equal those after step 3.
    assert all(p.isfinite().all() for p in model.parameters())
    assert trainer.total_skips == 3
    state = trainer.engine.optimizer.state[model.head.weight]
    assert int(state["step"]) == 3


def test_nan_skip_recovers(tmp_path):
    class OneNaN(TinyLM):
        calls = 0

        def forward(self, inputs, targets):
            self.calls += 1
            loss = super().forward(inputs, targets)
            return loss * float("nan") if self.calls == 2 else loss

    model = OneNaN()
    out = Trainer(model, _cfg(max_steps=4), SeqData(4), run_dir=tmp_path).fit()
    assert out["total_skips"] == 1 and out["step"] == 4
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.slow
def test_ddp_two_ranks_with_accumulation_match_single_process(tmp_path):
    from launch import run

    run("train_tiny.py", {"run_dir": str(tmp_path / "ddp"), "max_steps": 6, "grad_accum": 2}, nproc=2)
    torch.manual_seed(0)
    cfg = _cfg(lr=1e-2, max_steps=6, t_max=None, micro_batch=4, grad_accum=2)
    cfg = TrainConfig(**{**cfg.to_dict(), "t_max": 6, "min_lr": 1e-4})
    # Same global rows: one process with micro-batches of 4 sees what 2 ranks x 2 rows see (SeqData splits rows).
    Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path / "one").fit()
    for a, b in zip(_losses(tmp_path / "ddp"), _losses(tmp_path / "one"), strict=True):
        assert a[0] == b[0] and abs(a[1] - b[1]) <= 1e-5 * abs(b[1]), (a, b)


def test_time_budget_ends_with_checkpoint_and_eval(tmp_path):
    torch.manual_seed(0)
    cfg = _cfg(max_steps=10**6, t_max=100, time_budget_s=1.0)
    out = Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path, eval_data=lambda: eval_batches()).fit()
    assert out["stopped"] == "time_budget" and 0 < out["step"] < 10**6
    assert out["eval"] is not None and latest_checkpoint(tmp_path).name == f"step_{out['step']:08d}"


@pytest.mark.parametrize("wrap", [lambda loss: {"loss": loss}, lambda loss: type("Out", (), {"loss": loss})()])
def test_model_output_forms(tmp_path, wrap):
    class Wrapped(TinyLM):
        def forward(self, inputs, targets):
            return wrap(super().forward(inputs, targets))

    out = Trainer(Wrapped(), _cfg(max_steps=2), SeqData(4), run_dir=tmp_path).fit()
    assert math.isfinite(out["loss"])


def test_bad_model_output_and_arguments(tmp_path):
    class NoLoss(TinyLM):
        def forward(self, inputs, targets):
            return (super().forward(inputs, targets),)

    with pytest.raises(TypeError, match="expected a loss Tensor"):
        Trainer(NoLoss(), _cfg(max_steps=1), SeqData(4), run_dir=tmp_path).fit()
    with pytest.raises(ValueError, match="engine='deepspeed'"):
        Trainer(TinyLM(), _cfg(), SeqData(4), run_dir=tmp_path, ds_config={})
    with pytest.raises(TypeError, match="eval_data must be a zero-argument callable"):
        Trainer(TinyLM(), _cfg(), SeqData(4), run_dir=tmp_path, eval_data=eval_batches())


@pytest.mark.parametrize("fault", [None, "autocast_off"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_torch_engine(tmp_path, monkeypatch, precision, fault):
    # The loss falling proves nothing about precision (fp32 training passes that too): the linear layers' outputs
    # during the training steps must be in the precision asked for. With autocast switched off, that check fails.
    if fault == "autocast_off":
        monkeypatch.setattr("trainloop.engine_torch.autocast", lambda device, precision: contextlib.nullcontext())
    torch.manual_seed(0)
    cfg = _cfg(max_steps=8, precision=precision, scaler_init_scale=2.0**10, scaler_growth_factor=1.001)
    model = TinyLM()
    seen = set()
    model.o_proj.register_forward_hook(lambda mod, args, out: seen.add(out.dtype) if mod.training else None)
    out = Trainer(model, cfg, SeqData(4), run_dir=tmp_path).fit()
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if fault is not None:
        assert seen == {torch.float32}  # what the dtype check below exists to catch
        return
    assert seen == {expected}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: fp32 master weights
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert out["total_skips"] == 0 and recs[-1]["loss"] < recs[0]["loss"]
    if precision == "fp16":
        # GradScaler with a slow growth factor (1.001): settable, logged, and saved for resume.
        assert recs[0]["loss_scale"] == 2.0**10
        state = torch.load(latest_checkpoint(tmp_path) / "trainer.pt", weights_only=False)
        assert state["scaler"]["growth_factor"] == 1.001
    else:
        assert "loss_scale" not in recs[0]


def test_mfu_uses_the_models_flops_and_the_stated_peak(tmp_path):
    class Counted(TinyLM):
        flops_per_token = 2.5e6  # as a model with PaLM's 6N + 12LHQT would expose it

    torch.manual_seed(0)
    trainer = Trainer(Counted(), _cfg(max_steps=3, peak_tflops=1.0), SeqData(4), run_dir=tmp_path)
    assert trainer.flops_source == "model.flops_per_token"
    trainer.fit()
    for rec in (json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()):
        assert rec["peak_tflops"] == 1.0
        assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * 2.5e6 / 1e12, rel=1e-12)
    plain = Trainer(TinyLM(), _cfg(max_steps=1), SeqData(4), run_dir=tmp_path / "plain")
    assert plain.flops_per_token == 6 * sum(p.numel() for p in TinyLM().parameters())
    assert plain.peak_tflops is None  # CPU: no peak known, so no MFU is claimed


@pytest.mark.parametrize("tty, tqdm_disable, bar", [(True, None, True), (True, "1", False), (False, None, False)])
def test_progress_bar_only_on_a_terminal_and_timestamped_lines(tmp_path, capsys, monkeypatch, tty, tqdm_disable, bar):
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    if tqdm_disable:
        monkeypatch.setenv("TQDM_DISABLE", tqdm_disable)
    torch.manual_seed(0)
    Trainer(TinyLM(), _cfg(max_steps=4, log_every=2, progress=True), SeqData(4), run_dir=tmp_path).fit()
    captured = capsys.readouterr()
    assert ("train:" in captured.err) == bar and ("\r" in captured.err) == bar  # tqdm draws on stderr
    lines = [
        ln.split("] ", 1)[1] for ln in captured.out.splitlines() if re.match(r"\[trainloop \d\d:\d\d:\d\d\] step ", ln)
    ]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2", "step 4"]
    assert all("lr " in ln and "gnorm " in ln and "tok/s " in ln and "mem " in ln for ln in lines)


class WriteLog:
    """A stdout that records every write call, as an unbuffered pipe would see them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("bar", [False, True])
def test_every_log_line_is_one_write(tmp_path, monkeypatch, bar):
    # Ranks share torchrun's stdout: a line whose newline comes as a second write lets another rank's line land in it.
    out = WriteLog()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr.isatty", lambda: bar)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    torch.manual_seed(0)
    Trainer(TinyLM(), _cfg(max_steps=4, log_every=1, progress=bar), SeqData(4), run_dir=tmp_path).fit()
    lines = [w for w in out.writes if w.strip()]
    assert sum("] step " in w for w in lines) == 4, out.writes
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in lines), out.writes


class StepClock:
    """Training time that advances one second per optimizer step: the budget's decisions become deterministic."""

    def __init__(self) -> None:
        self.trainer = None

    def __call__(self) -> float:
        return 0.0 if self.trainer is None else float(self.trainer.step)


class CrashAt(SeqData):
    def __init__(self, batch, at):
        super().__init__(batch)
        self.at = at

    def __next__(self):
        if self.pos == self.at:
            raise RuntimeError("simulated crash")
        return super().__next__()


def _budget_run(run_dir, data, resume=False):
    from trainloop import BudgetSchedule

    torch.manual_seed(0)
    cfg = _cfg(max_steps=1000, warmup_steps=2, min_lr=1e-4, time_budget_s=20.0, save_every=4)
    clock = StepClock()
    trainer = Trainer(TinyLM(), cfg, data, run_dir=run_dir, schedule=BudgetSchedule(cfg), clock=clock)
    clock.trainer = trainer
    return trainer, trainer.fit(resume=resume)


def test_budget_schedule_replans_inside_one_fit_and_resumes_bit_exact(tmp_path, capsys):
    trainer, out = _budget_run(tmp_path / "a", SeqData(4))
    printed = capsys.readouterr().out
    # The ranks agree on the time before each optimizer step, so step s sees s - 1 seconds here: re-planned at 20%
    # of the budget (step 5: 5 steps in 4 s, 16 s left) and at 55% (step 12, 11 s), inside the one fit().
    assert [p["at_step"] for p in trainer.schedule.plans] == [5, 12]
    assert "re-planned at step 5: 1.25 steps/s -> 23 steps, decay from step 14" in printed
    assert out["step"] == trainer.schedule.max_steps == 20 and out["stopped"] is None
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in recs if "lr" in r]
    assert lrs[2:13] == [1e-2] * 11 and lrs[-1] < lrs[-2] < lrs[13] < 1e-2  # constant, then the planned decay
    # Crash after the checkpoint at step 8, resume: the plan comes back from the checkpoint, the rest is identical.
    with pytest.raises(RuntimeError, match="simulated crash"):
        _budget_run(tmp_path / "b", CrashAt(4, at=10))
    resumed, out_b = _budget_run(tmp_path / "b", SeqData(4), resume=True)
    assert out_b["step"] == 20 and resumed.schedule.plans == trainer.schedule.plans
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    wa = load_model_weights(latest_checkpoint(tmp_path / "a"))
    wb = load_model_weights(latest_checkpoint(tmp_path / "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


class Harder:
    """Evaluation batches that get harder at each evaluation after the first `easy` ones (noise targets)."""

    def __init__(self, easy):
        self.calls, self.easy = 0, easy

    def __call__(self):
        self.calls += 1
        batches = eval_batches()
        if self.calls <= self.easy:
            return batches
        g = torch.Generator().manual_seed(self.calls)
        return [(x, torch.randint(0, 32, y.shape, generator=g)) for x, y in batches]


def test_best_checkpoint_is_kept_when_the_loss_rises(tmp_path):
    from trainloop import CheckpointStore

    torch.manual_seed(0)
    cfg = _cfg(max_steps=12, eval_every=3, keep_last=1)
    out = Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path, eval_data=Harder(easy=2)).fit()
    store = CheckpointStore(tmp_path)
    assert out["best"]["step"] == 6 and store.best()["step"] == 6  # evaluations at 3, 6 improve; 9, 12 do not
    assert store.steps() == [6, 12]  # keep_last=1 prunes everything but the newest and the best
    assert store.resolve("best")[0].name == "step_00000006"
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert [e["step"] for e in evals] == [3, 6, 9, 12]
    assert min(evals, key=lambda e: e["eval_loss"])["step"] == 6


def test_early_stopping_fires_after_patience_and_not_before(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = _cfg(max_steps=30, eval_every=2, early_stopping_patience=3)
    out = Trainer(TinyLM(), cfg, SeqData(4), run_dir=tmp_path, eval_data=Harder(easy=2)).fit()
    # Best at the 2nd evaluation (step 4); the 3rd, 4th and 5th do not improve: stop at step 10.
    assert out["stopped"] == "early_stopping" and out["step"] == 10 and out["best"]["step"] == 4
    assert "stopped: early_stopping at step 10, best at step 4 (eval loss" in capsys.readouterr().out
    torch.manual_seed(0)
    patient = _cfg(max_steps=30, eval_every=2, early_stopping_patience=4)
    out = Trainer(TinyLM(), patient, SeqData(4), run_dir=tmp_path / "p", eval_data=Harder(easy=2)).fit()
    assert out["step"] == 12 and out["stopped"] == "early_stopping"


def test_timed_evaluations_take_at_most_a_tenth_of_the_time(tmp_path):
    class SlowEval:
        """Each evaluation costs 5 'seconds' of the step clock."""

        def __init__(self, clock):
            self.clock, self.calls = clock, 0

        def __call__(self):
            self.calls += 1
            self.clock.offset += 5.0
            return eval_batches()

    class Clock(StepClock):
        offset = 0.0

        def __call__(self):
            return super().__call__() + self.offset

    torch.manual_seed(0)
    clock = Clock()
    evals = SlowEval(clock)
    trainer = Trainer(TinyLM(), _cfg(max_steps=200, eval_every_s=1.0), SeqData(4), run_dir=tmp_path,
                      eval_data=evals, clock=clock)  # fmt: skip
    clock.trainer = trainer
    trainer.fit()
    # Asked for every second, but 5 s per evaluation allows one per 50 s: 200 training + 5 per evaluation.
    assert 4 <= evals.calls - 1 <= 5  # minus the final evaluation


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_resume_that_finds_no_usable_checkpoint_changes_nothing(tmp_path):
    cfg = TrainConfig(max_steps=4, save_every=2, progress=False, tensorboard=False, micro_batch=8)
    Trainer(TinyLM(), cfg, SeqData(8), run_dir=tmp_path).fit()
    for state in (tmp_path / "checkpoints").glob("step_*/rank0.pt"):
        state.write_bytes(state.read_bytes()[:-7])  # cut short: the weights are intact, the checkpoint is not
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"2 checkpoint\(s\), none usable .*nothing was changed"):
        Trainer(TinyLM(), cfg, SeqData(8), run_dir=tmp_path).fit(resume=True)
    assert _snapshot(tmp_path) == before


def test_a_run_directory_linking_outside_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside / "notes.txt")
    cfg = TrainConfig(max_steps=2, progress=False, tensorboard=False, micro_batch=8)
    with pytest.raises(CheckpointError, match="metrics.jsonl is a symbolic link to .*outside the run directory"):
        Trainer(TinyLM(), cfg, SeqData(8), run_dir=run)
    assert not (outside / "notes.txt").exists()


def test_a_log_line_while_a_bar_is_showing_goes_through_tqdm_and_not_into_the_bar(capsys):
    import io
    import types
    from unittest import mock

    from tqdm import tqdm

    from trainloop.trainer import Trainer

    said = types.SimpleNamespace(is_main=True)
    with tqdm(total=10, file=io.StringIO()) as bar, mock.patch.object(tqdm, "write") as write:
        Trainer._say(said, "eval at step 3: loss 1.0 nats/token")
        bar.update(1)
    assert write.call_count == 1 and write.call_args.args[0].endswith("eval at step 3: loss 1.0 nats/token\n")
    Trainer._say(said, "no bar now")  # without a bar: straight to stdout
    assert capsys.readouterr().out.endswith("no bar now\n")


def test_log_lines_say_how_long_is_left(tmp_path, capsys):
    torch.manual_seed(0)
    Trainer(TinyLM(), _cfg(max_steps=6, log_every=2), SeqData(4), run_dir=tmp_path).fit()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    etas = [r["eta_s"] for r in records if "loss" in r]
    assert len(etas) == 3 and all(e >= 0 for e in etas) and etas[-1] == 0.0  # nothing left at the last step
    lines = [line for line in capsys.readouterr().out.splitlines() if "| loss " in line]
    assert len(lines) == 3 and all(re.search(r"\| eta \d+s", line) for line in lines), lines
