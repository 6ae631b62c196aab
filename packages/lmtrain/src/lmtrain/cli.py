"""The `lmtrain` command line: prepare, train, finetune, eval, generate, export, doctor, demo.

The flags live in lmtrain.parsers. Each subcommand's work lives in its own module, imported only when that
subcommand runs, so that `lmtrain --help` stays fast and works even where torch or DeepSpeed are slow to import;
every command's errors become one line here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lmtrain.parsers import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lmtrain` command; returns the process exit status."""
    args = build_parser().parse_args(argv)
    found = {name: os.environ.get(name) for name in SET_FOR_THE_COMMAND}
    try:
        return _run_command(args)
    except KeyboardInterrupt:
        # A first Ctrl-C during `train` saves and stops at the next step; a second one, or Ctrl-C in any other
        # command (or while one starts), stops at once. 130: the shell's status for a process ended by SIGINT.
        kept = "; the newest complete checkpoint is kept (--resume continues from it)"
        kept = kept if args.command in ("train", "finetune") else ""
        print(f"lmtrain {args.command}: interrupted (Ctrl-C): stopped at once{kept}", file=sys.stderr)
        return 130
    finally:
        restore_environ(found)


# What _run_command sets in the environment for the command's own duration; main() leaves the rest as it found it.
SET_FOR_THE_COMMAND = ("TQDM_DISABLE", "LOCAL_RANK")


def restore_environ(found: dict[str, str | None]) -> None:
    """Put back the variables ``found`` recorded (a name recorded as None is removed)."""
    for name, value in found.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def quiet_other_libraries() -> None:
    """Silence what other libraries print that a user cannot act on: torchao's "Failed to load" lines for kernels
    of other hardware, DeepSpeed's notice that it fell back to the CPU (where torch sees no GPU, the CPU is said
    explicitly: DS_ACCELERATOR=cpu), transformers' deprecation notices about its own internals. lmtrain's own
    warnings, and every error, still show."""
    import logging
    import warnings

    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def _run_command(args: argparse.Namespace) -> int:
    if args.launcher_local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.launcher_local_rank))
    if args.no_progress:  # tqdm reads it in every package, trainloop's loop too
        os.environ["TQDM_DISABLE"] = "1"
    if args.command != "doctor":
        quiet_other_libraries()
    # Lazy imports: each subcommand pulls in only what it needs.
    if args.command == "prepare":
        from lmtrain.prepare_data import run_prepare as run
    elif args.command == "train":
        from lmtrain.train_run import run_train as run
    elif args.command == "eval" and args.tasks is not None:
        from lmtrain.harness import run_tasks as run
    elif args.command == "finetune":
        from lmtrain.finetune_run import run_finetune as run
    elif args.command == "eval":
        from lmtrain.evaluate import run_eval as run
    elif args.command == "generate":
        from lmtrain.sample import run_generate as run
    elif args.command == "export":
        from lmtrain.export import run_export as run
    elif args.command == "doctor":
        from lmtrain.doctor import run_doctor as run
    else:
        from lmtrain.demo import run_demo as run
    from lmtrain.errors import WRITE_ERRNOS, LmtrainError, no_space_message
    from lmtrain.run_lock import output_lock

    # One writer per output directory (`train` takes its lock itself, in lmtrain.train).
    writes = args.out if args.command in ("prepare", "demo") else None
    try:
        with output_lock(args.command, writes):
            return int(run(args) or 0)
    except LmtrainError as err:
        print(f"lmtrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        from lmcore.extras import MissingExtraError as LmcoreMissing
        from trainloop.extras import MissingExtraError as TrainloopMissing

        if not isinstance(err, (LmcoreMissing, TrainloopMissing)):
            raise
        print(f"lmtrain {args.command}: error: {err}", file=sys.stderr)  # names the extra to install
        return 2
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        print(f"lmtrain {args.command}: error: {no_space_message(err, getattr(args, 'out', None))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
