import json

import pytest

from trainloop import TrainConfig

BAD = [
    ("lr", 0.0),
    ("lr", float("nan")),
    ("min_lr", -1.0),
    ("min_lr", 1.0),  # above lr
    ("warmup_steps", -1),
    ("schedule", "linear"),
    ("t_max", 0),
    ("wsd_decay_steps", -3),
    ("beta1", 1.0),
    ("beta2", -0.1),
    ("eps", 0.0),
    ("weight_decay", -0.1),
    ("max_steps", 0),
    ("micro_batch", 0),
    ("grad_accum", 1.5),
    ("precision", "fp8"),
    ("scaler_init_scale", 0.0),
    ("scaler_growth_factor", 1.0),
    ("scaler_backoff_factor", 1.5),
    ("scaler_growth_interval", 0),
    ("clip", -1.0),
    ("clip_groups", {"embed.*": -2.0}),
    ("clip_groups", ["embed.*"]),
    ("log_every", 0),
    ("eval_every", -1),
    ("save_every", -5),
    ("eval_batches", 0),
    ("keep_last", 0),
    ("seed", -1),
    ("seed", 2**32),
    ("seed", 10**20),
    ("time_budget_s", 0.0),
    ("engine", "jax"),
    ("zero_stage", 4),
    ("max_consecutive_skips", 0),
    ("detect_anomaly", "yes"),
    ("dist_timeout_s", 0),
    ("peak_tflops", -1.0),
    ("flops_per_token", 0.0),
    ("inspect_steps", [0]),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**{field: value})


def test_defaults_and_round_trip():
    cfg = TrainConfig(max_steps=50, clip_groups={"embed.*": 2.0}, precision="bf16", inspect_steps=[5])
    assert cfg.t_max == 50  # defaults to max_steps
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="no field"):
        TrainConfig.from_dict({"learning_rate": 1.0})


def test_clip_groups_from_calibration_json(tmp_path):
    path = tmp_path / "clip.json"
    path.write_text(json.dumps({"thresholds": {"embed.*": 2.0, "*": 1.0}, "percentile": 95}))
    assert TrainConfig(clip_groups=str(path)).clip_groups == {"embed.*": 2.0, "*": 1.0}
    with pytest.raises(ValueError, match="TrainConfig.clip_groups: cannot read"):
        TrainConfig(clip_groups=str(tmp_path / "missing.json"))
