import dataclasses

import pytest

from lmtrain.errors import OverrideError
from lmtrain.overrides import apply_overrides, convert, parse_pairs


@dataclasses.dataclass
class Train:
    lr: float = 1e-3
    log_every: int = 10
    precision: str = "fp32"
    max_steps: int | None = None
    clip_groups: dict[str, float] | None = None
    inspect_steps: list[int] = dataclasses.field(default_factory=list)
    progress: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"Train.precision={self.precision!r} is invalid")


@dataclasses.dataclass
class Model:
    d_model: int = 64
    dropout: float = 0.0
    seed: int = 0


def test_values_convert_by_field_type():
    out = apply_overrides(
        ["lr=3e-4", "log_every=1", "precision=bf16", "max_steps=1e3", 'clip_groups={"*embed*": 2.0}',
         "inspect_steps=[5, 10]", "progress=false", "d_model=128"],
        {"train": Train(), "model": Model()},
    )  # fmt: skip
    train, model = out["train"], out["model"]
    assert (train.lr, train.log_every, train.precision, train.max_steps) == (3e-4, 1, "bf16", 1000)
    assert train.clip_groups == {"*embed*": 2.0} and train.inspect_steps == [5, 10] and train.progress is False
    assert model.d_model == 128


def test_optional_field_accepts_none():
    assert apply_overrides(["max_steps=none"], {"train": Train(max_steps=5)})["train"].max_steps is None


def test_unknown_key_lists_near_matches():
    with pytest.raises(OverrideError, match="did you mean log_every"):
        apply_overrides(["log_evry=1"], {"train": Train(), "model": Model()})


def test_wrong_type_names_the_key():
    with pytest.raises(OverrideError, match="log_every=ten"):
        apply_overrides(["log_every=ten"], {"train": Train()})


def test_config_validation_is_reported_as_override_error():
    with pytest.raises(OverrideError, match="precision"):
        apply_overrides(["precision=fp8"], {"train": Train()})


def test_shared_name_sets_every_config_unless_prefixed():
    both = apply_overrides(["seed=3"], {"train": Train(), "model": Model()})
    assert both["train"].seed == 3 and both["model"].seed == 3
    one = apply_overrides(["model.seed=4"], {"train": Train(), "model": Model()})
    assert one["train"].seed == 0 and one["model"].seed == 4


def test_inputs_are_not_mutated():
    train = Train()
    apply_overrides(["lr=0.5"], {"train": train})
    assert train.lr == 1e-3


@pytest.mark.parametrize("bad", ["novalue", "=3", ""])
def test_malformed_pair(bad):
    with pytest.raises(OverrideError, match="key=value"):
        parse_pairs([bad])


def test_bool_rejects_garbage():
    with pytest.raises(OverrideError, match="boolean"):
        convert("maybe", bool, key="progress")


def test_real_configs_accept_their_field_names():
    from lmcore import ModelConfig
    from trainloop import TrainConfig

    out = apply_overrides(
        ["save_every=10", "log_every=1", "precision=fp32", "n_layer=3"],
        {"model": ModelConfig.from_preset("tiny"), "train": TrainConfig()},
    )
    assert (out["train"].save_every, out["train"].log_every, out["train"].precision) == (10, 1, "fp32")
    assert out["model"].n_layer == 3


@pytest.mark.parametrize(("asked", "ours"), [("learning_rate", "lr"), ("gradient_accumulation_steps", "grad_accum"),
                                             ("block_size", "seq_len"), ("n_embd", "d_model")])  # fmt: skip
def test_unknown_key_suggests_our_name_for_the_same_setting_first(asked, ours):
    from lmcore import ModelConfig
    from lmtrain.recipes import DataConfig
    from trainloop import TrainConfig

    configs = {"model": ModelConfig.from_preset("tiny"), "train": TrainConfig(), "data": DataConfig()}
    with pytest.raises(OverrideError) as err:
        apply_overrides([f"{asked}=1"], configs)
    assert f"did you mean {ours}" in str(err.value), str(err.value)


def test_every_synonym_names_a_real_field():
    from lmcore import ModelConfig
    from lmtrain.overrides import SYNONYMS
    from lmtrain.recipes import DataConfig
    from trainloop import TrainConfig

    fields = {f.name for c in (ModelConfig, TrainConfig, DataConfig) for f in dataclasses.fields(c)}
    assert set(SYNONYMS.values()) <= fields and not set(SYNONYMS) & fields
