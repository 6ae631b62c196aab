"""Train TinyLM with trainloop; launched by the tests directly or under torchrun. Arguments are JSON overrides."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_model import BlocksLM, SeqData, TinyLM, eval_batches  # noqa: E402

from trainloop import TrainConfig, Trainer  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    run_dir = args.pop("run_dir")
    resume = args.pop("resume", False)
    ds_config = args.pop("ds_config", None)
    global_batch = args.pop("global_batch", 8)
    hook = args.pop("slow_save_at", None)
    args_hang = args.pop("hang_rank_at", None)
    args_nan = args.pop("nan_at", None)
    fault = args.pop("fault", None)
    if fault == "optimizer_state_dropped":  # a broken resume, for the tests to show that they catch it
        import trainloop.engine_torch as et

        real_load = et.TorchEngine.load

        def load_without_optimizer(self, ckpt_dir, saved_world_size):
            fresh = self.optimizer.state_dict()  # no moments yet
            state = real_load(self, ckpt_dir, saved_world_size)
            self.optimizer.load_state_dict(fresh)
            return state

        et.TorchEngine.load = load_without_optimizer
    watch_open = args.pop("watch_open", None)  # print OPENED <path> when a file whose path holds this is opened
    if watch_open is not None:
        sys.addaudithook(lambda event, a: event == "open" and watch_open in str(a[0]) and os.write(
            1, f"OPENED {a[0]}\n".encode()))  # fmt: skip
    refusals = args.pop("refusals", False)  # a CheckpointError ends the script with REFUSED <rank> <line>, status 3
    check_weights = args.pop("check_weights", False)
    uneven_eval = args.pop("uneven_eval", False)  # rank 0 evaluates 3 batches, the others 1
    kind = args.pop("model", "tiny")  # "tiny", "blocks" or "blocks_ckpt" (activation checkpointing)
    width = args.pop("width", 16)  # TinyLM's width: 1024 gives o_proj 1M elements, enough for NVMe swapping
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    base = dict(lr=1e-2, min_lr=1e-4, warmup_steps=2, max_steps=10, log_every=1, progress=False, tensorboard=False)
    base.update(args)
    base["micro_batch"] = global_batch // world // base.get("grad_accum", 1)
    cfg = TrainConfig(**base)
    if hook is not None:
        import time

        import trainloop.checkpoint as ck

        real = ck.save_model_weights

        def slow(state, path):
            real(state, path)
            if f"{hook:08d}" in str(path.parent):
                os.write(1, ("SAVE_IN_PROGRESS" + "\n").encode())  # one write: ranks share stdout
                time.sleep(60)

        ck.save_model_weights = slow
        import trainloop.engine_torch as et

        et.save_model_weights = slow
    hang = args_hang
    torch.manual_seed(0)
    model = TinyLM(d=width) if kind == "tiny" else BlocksLM(checkpointing=kind == "blocks_ckpt")
    if hang is not None and rank == hang[0]:
        import time

        real_forward = model.forward
        calls = {"n": 0}

        def forward(inputs, targets):
            calls["n"] += 1
            if calls["n"] > hang[1] * cfg.grad_accum:
                import signal

                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # let torchrun end the hung rank at once
                os.write(1, (f"rank {rank} hangs" + "\n").encode())  # one write: ranks share stdout
                time.sleep(600)
            return real_forward(inputs, targets)

        model.forward = forward
    nan_at = args_nan
    if nan_at is not None and rank == nan_at[0]:
        plain_forward = model.forward
        seen = {"n": 0}

        def nan_forward(inputs, targets):
            seen["n"] += 1
            loss = plain_forward(inputs, targets)
            in_step = (nan_at[1] - 1) * cfg.grad_accum < seen["n"] <= nan_at[1] * cfg.grad_accum
            return loss * float("nan") if in_step else loss

        model.forward = nan_forward
    data = SeqData(cfg.micro_batch, rank=rank, world_size=world)
    n_eval = (3 if rank == 0 else 1) if uneven_eval else 2
    trainer = Trainer(model, cfg, data, run_dir=run_dir, eval_data=lambda: eval_batches(n_eval), ds_config=ds_config)
    if refusals:
        from trainloop.checkpoint import CheckpointError

        try:
            out = trainer.fit(resume=resume)
        except CheckpointError as exc:
            os.write(1, f"REFUSED {rank} {exc}\n".encode())
            sys.exit(3)
    else:
        out = trainer.fit(resume=resume)
    if check_weights:
        # The final checkpoint's consolidated weights against the live (sharded) parameters: each rank compares its own
        # shard with that region of the saved tensor, and each rank's largest difference is summed over the ranks by
        # trainloop's all-reduce. No gather: DTensor's full_tensor() hands gloo temporaries, and a worker thread that
        # releases one after the interpreter began to finalise aborts the process (trainloop.distributed, _BUFFERS):
        # 4 of 28 runs of this script did so on Python 3.10 beside a test session, 0 of 30 since.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from trainloop import load_model_weights
        from trainloop.distributed import all_reduce_sum

        saved = load_model_weights(out["checkpoint"])
        worst = 0.0
        for n, p in model.named_parameters():
            if hasattr(p, "to_local"):  # a DTensor shard: its region of the whole tensor
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                want, local = saved[n][tuple(slice(o, o + k) for o, k in zip(offset, shape, strict=True))], p.to_local()
            else:
                want, local = saved[n], p
            if local.numel():
                worst = max(worst, float((want - local.detach().float()).abs().max()))
        diff = float(all_reduce_sum(torch.tensor([worst], dtype=torch.float64))[0])
        names = sorted(n for n, _ in model.named_parameters())
        if rank == 0:
            os.write(1, ("WEIGHTS " + json.dumps({"abs_diff": diff, "names": names}) + "\n").encode())
    if rank == 0:
        os.write(1, ("SUMMARY " + json.dumps(out) + "\n").encode())  # one write: ranks share stdout


if __name__ == "__main__":
    main()
