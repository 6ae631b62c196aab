"""A raw-PyTorch training loop on DeepSpeed ZeRO-2 or plain torch.

Per-group clipping, closed-form schedules, atomic checkpoints, exact resume.
"""

from trainloop.budget import BUDGET, BudgetPolicy, BudgetSchedule
from trainloop.calibration import calibrate
from trainloop.checkpoint import CheckpointError, CheckpointStore, latest_checkpoint, load_model_weights
from trainloop.clipping import ClipGroups, ClipReport, adamw_param_groups
from trainloop.config import ConfigError, TrainConfig, load_clip_groups
from trainloop.ds_config import Adoption, ResolvedDSConfig, adopt_ds_config, build_ds_config
from trainloop.engine import Engine, StepReport, make_engine
from trainloop.evaluation import evaluate
from trainloop.faults import CollectiveError, NonFiniteLossError
from trainloop.plotting import plot_metrics
from trainloop.schedules import ConfigSchedule, Schedule, lr_at
from trainloop.state import TrainState
from trainloop.trainer import StepResult, Trainer
from trainloop.version import __version__

__all__ = [
    "BUDGET",
    "Adoption",
    "BudgetPolicy",
    "BudgetSchedule",
    "CheckpointError",
    "CheckpointStore",
    "ClipGroups",
    "ClipReport",
    "CollectiveError",
    "ConfigError",
    "ConfigSchedule",
    "Engine",
    "NonFiniteLossError",
    "ResolvedDSConfig",
    "Schedule",
    "StepReport",
    "StepResult",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "__version__",
    "adamw_param_groups",
    "adopt_ds_config",
    "build_ds_config",
    "calibrate",
    "evaluate",
    "latest_checkpoint",
    "load_clip_groups",
    "load_model_weights",
    "lr_at",
    "make_engine",
    "plot_metrics",
]
