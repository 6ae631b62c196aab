"""LoRA: low-rank adapters on chosen linear layers, merged back or saved on their own.

W x + (alpha / r) * B A dropout(x), with A (r, in) kaiming-uniform and B (out, r) zeros, so an adapted model
computes exactly what the base model does until B is trained.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from lmcore.file_writes import write_safetensors

# Short target names -> the attribute names of the linear layers in lmcore.model.
TARGET_MODULES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
DEFAULT_TARGETS = ("q", "k", "v", "o")
# What save_lora and save_pretrained record of the adapters, in the weights file's metadata.
SETTINGS_FIELDS = ("targets", "r", "alpha", "dropout")
BASE_METADATA = "lora_base_sha256"  # save_lora: base_fingerprint() of the weights the adapters were trained on

# apply_lora, merge_lora and load_lora change a model in place and return it: the caller's type comes back.
M = TypeVar("M", bound=nn.Module)


# The adapters of a base held in 16 bits train in fp32, as PEFT's do: an AdamW step of lr 2e-4 on a bf16 weight of
# size 0.02 is below its rounding step (2**-8 relative) and would be lost. Their bytes are a few per cent of the base's.
LOW_PRECISION = (torch.bfloat16, torch.float16)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update scaled by alpha / r; the update in fp32 where the base is
    in bf16 or fp16 (:data:`LOW_PRECISION`), added to the base's output in the base's dtype."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        device, dtype = base.weight.device, base.weight.dtype
        dtype = torch.float32 if dtype in LOW_PRECISION else dtype
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device, dtype=dtype))
        # The same kaiming-uniform nn.Linear and PEFT use for A; B = 0 keeps the output unchanged at step 0.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        x = self.lora_dropout(x)
        if not torch.is_autocast_enabled(x.device.type):  # a 16-bit base outside autocast: fp32 like the adapters
            x = x.to(self.lora_A.dtype)  # (under autocast a copy per adapter would be kept for the backward)
        update = x @ self.lora_A.t() @ self.lora_B.t()  # (..., in) -> (..., r) -> (..., out)
        return out + (update * self.scaling).to(out.dtype)

    def merged_weight(self) -> Tensor:
        """W + (alpha / r) B A in the base weight's dtype: the weight of a plain Linear computing the same function
        (without dropout); the sum is formed in the adapters' precision and rounded once."""
        delta = (self.lora_B @ self.lora_A) * self.scaling
        return (self.base.weight.to(delta.dtype) + delta).to(self.base.weight.dtype)


def resolve_targets(targets: Iterable[str]) -> set[str]:
    """LoRA targets (q, k, v, o, gate, up, down, "mlp", or the layer names themselves) as the names of lmcore's
    linear layers; an unknown one is a ValueError naming the choices."""
    names = set()
    for t in targets:
        if t == "mlp":
            names |= {"gate_proj", "up_proj", "down_proj"}
        elif t in TARGET_MODULES:
            names.add(TARGET_MODULES[t])
        elif t in TARGET_MODULES.values():
            names.add(t)
        else:
            raise ValueError(f"unknown LoRA target {t!r}; choose from {sorted(TARGET_MODULES)} or 'mlp'")
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapter in `model` by its module name, e.g. 'layers.0.self_attn.q_proj'."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(
    model: M,
    targets: Iterable[str] = DEFAULT_TARGETS,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
) -> M:
    """Replace the target linear layers of `model` by LoRA adapters in place and freeze everything else.

    `targets`: any of q, k, v, o, gate, up, down, or "mlp" for all MLP layers. Afterwards only the
    adapters' A and B require grad. Returns `model`.

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> model = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=64, alpha=16, dropout=0.1)
        >>> all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
        True
    """
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be a positive int, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"LoRA alpha must be a finite number > 0 (the update is scaled alpha / r), got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise ValueError("model already has LoRA adapters; merge_lora() it first")
    wanted = resolve_targets(targets)
    found = [
        (parent, attr)
        for parent in model.modules()
        for attr, child in parent.named_children()
        if attr in wanted and isinstance(child, nn.Linear)
    ]
    if not found:
        raise ValueError(f"no linear layer named {sorted(wanted)} in the model (swiglu-only 'gate'?)")
    base = base_fingerprint(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, attr in found:
        setattr(parent, attr, LoRALinear(getattr(parent, attr), r, alpha, dropout))
    # torch annotates nn.Module.__setattr__'s value as Tensor | Module; any other value is a plain attribute.
    model.lora_settings = {"targets": sorted(wanted), "r": r, "alpha": alpha, "dropout": dropout}  # type: ignore[assignment]
    model.lora_base_sha256 = base  # type: ignore[assignment]
    return model


def base_fingerprint(model: nn.Module) -> str | None:
    """SHA-256 of the base weights the adapters of ``model`` sit on (all parameters but the adapters', by their
    names without LoRA's ``.base``, in order), rounded to bfloat16 so that a base loaded in fp32 or bf16 is the same
    base; None for a quantized base (NF4 weights are not the weights the adapters were trained on top of).

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> _ = torch.manual_seed(0); a = GPT(ModelConfig.from_preset("tiny"))
        >>> _ = torch.manual_seed(0); b = GPT(ModelConfig.from_preset("tiny"))
        >>> base_fingerprint(a) == base_fingerprint(apply_lora(b, r=4)) == base_fingerprint(a.to(torch.bfloat16))
        True
    """
    if any(type(m).__name__ == "NF4Linear" for m in model.modules()):
        return None
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        t = p.detach()
        full = getattr(t, "full_tensor", None)  # a DTensor shard: the whole weight (a collective)
        t = (full() if full is not None else t).to("cpu", torch.bfloat16).contiguous()
        h.update(f"{name.replace('.base.', '.')}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _non_finite(tensors: dict[str, Tensor]) -> str | None:
    """The name of the first tensor holding NaN or inf, or None."""
    return next((name for name, t in tensors.items() if not bool(torch.isfinite(t).all())), None)


@torch.no_grad()
def merge_lora(model: M) -> M:
    """Fold every adapter into its base weight and put the plain nn.Linear back; all parameters require grad again.

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4).eval()
        >>> _ = torch.nn.init.normal_(model.layers[0].self_attn.q_proj.lora_B)  # as if trained
        >>> ids = torch.randint(0, 97, (1, 8))
        >>> adapted = model(ids).logits
        >>> merged = merge_lora(model)
        >>> torch.allclose(merged(ids).logits, adapted, atol=1e-5), lora_modules(merged)
        (True, {})
    """
    adapters = lora_modules(model)
    if not adapters:
        raise ValueError("model has no LoRA adapters to merge")
    bad = _non_finite({f"{n}.{part}": getattr(a, part) for n, a in adapters.items() for part in ("lora_A", "lora_B")})
    if bad is not None:
        raise ValueError(f"LoRA adapter {bad} holds NaN or inf values: merging would ruin the base weights; merge "
                         "adapters from an earlier checkpoint (a diverged fine-tune)")  # fmt: skip
    recorded = getattr(model, "lora_base_sha256", None)
    if recorded is not None and (now := base_fingerprint(model)) is not None and now != recorded:
        raise ValueError(f"the base weights changed since the adapters were put on them (sha256 {recorded[:12]}... "
                         f"then, {now[:12]}... now): merge them into the base they were trained on")  # fmt: skip
    for name, adapter in adapters.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        adapter.base.weight.copy_(adapter.merged_weight())
        setattr(parent, attr, adapter.base)
    for p in model.parameters():
        p.requires_grad_(True)
    model.__dict__.pop("lora_settings", None)
    model.__dict__.pop("lora_base_sha256", None)
    return model


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter weights by name (``<module>.lora_A``, ``<module>.lora_B``), whole: an adapter sharded over ranks
    (a DTensor, under FSDP) is gathered, which is a collective: call it on every rank then.

    Example:
        >>> from lmcore import GPT, ModelConfig
        >>> model = apply_lora(GPT(ModelConfig.from_preset("tiny")), targets=["q"], r=4)
        >>> sorted(lora_state(model))[:2], tuple(lora_state(model)["layers.0.self_attn.q_proj.lora_A"].shape)
        (['layers.0.self_attn.q_proj.lora_A', 'layers.0.self_attn.q_proj.lora_B'], (4, 64))
    """
    tensors = {}
    for name, adapter in lora_modules(model).items():
        for part in ("lora_A", "lora_B"):
            t = getattr(adapter, part).detach()
            full = getattr(t, "full_tensor", None)
            tensors[f"{name}.{part}"] = (full() if full is not None else t).contiguous()
    return tensors


def save_lora(model: nn.Module, path: str | os.PathLike[str], tensors: dict[str, Tensor] | None = None) -> Path:
    """Write only the adapter weights (A and B) to a safetensors file, with r, alpha, dropout, targets as metadata.
    ``tensors``: the weights as :func:`lora_state` gathered them (on every rank, for adapters sharded over ranks);
    by default they are read off the model.

    Example:
        >>> import json, tempfile
        >>> from safetensors import safe_open
        >>> from lmcore import GPT, ModelConfig
        >>> out = tempfile.TemporaryDirectory()
        >>> model = apply_lora(GPT(ModelConfig.from_preset("tiny")), targets=["q", "v"], r=4)
        >>> with safe_open(save_lora(model, f"{out.name}/adapters.safetensors"), framework="pt") as f:
        ...     keys, settings = sorted(f.keys()), json.loads(f.metadata()["lora_settings"])
        >>> len(keys), keys[:2]  # 2 layers x 2 targets x (A, B)
        (8, ['layers.0.self_attn.q_proj.lora_A', 'layers.0.self_attn.q_proj.lora_B'])
        >>> settings
        {'targets': ['q_proj', 'v_proj'], 'r': 4, 'alpha': 16.0, 'dropout': 0.0}
        >>> out.cleanup()
    """
    if not lora_modules(model):
        raise ValueError("model has no LoRA adapters to save")
    tensors = lora_state(model) if tensors is None else tensors
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"lora_settings": json.dumps(model.lora_settings)}
    base = getattr(model, "lora_base_sha256", None)
    if base is not None:
        metadata[BASE_METADATA] = base
    return write_safetensors(tensors, path, metadata)


def read_lora_settings(text: str, where: str | os.PathLike[str]) -> dict[str, Any]:
    """The adapter settings a weights file's ``lora_settings`` metadata holds, checked: anything but an object with
    every field of ``SETTINGS_FIELDS`` (targets a list of names, alpha and dropout numbers) is a ValueError that
    names ``where`` and the field; the values themselves are checked by ``apply_lora``.

    Example:
        >>> read_lora_settings('{"targets": ["q_proj"], "r": 4, "alpha": 8, "dropout": 0.0}', "a.safetensors")["r"]
        4
        >>> read_lora_settings('{"r": 4}', "a.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: a.safetensors: lora_settings metadata lacks targets, alpha, dropout (save_lora writes ...)
    """
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: lora_settings metadata is not JSON ({exc})") from None
    expected = ", ".join(SETTINGS_FIELDS)
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: lora_settings metadata holds a {type(settings).__name__}, expected an object with "
                         f"{expected}")  # fmt: skip
    missing = [f for f in SETTINGS_FIELDS if f not in settings]
    if missing:
        raise ValueError(f"{where}: lora_settings metadata lacks {', '.join(missing)} (save_lora writes {expected})")
    targets = settings["targets"]
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{where}: lora_settings targets={targets!r}: expected a list of module names")
    for field in ("alpha", "dropout"):
        value = settings[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: lora_settings {field}={value!r}: expected a finite number")
    return settings


def load_lora(model: M, path: str | os.PathLike[str]) -> M:
    """Load adapters saved by `save_lora` into `model`, applying LoRA first (with the saved settings) if needed.

    A key or shape that does not match the model raises ValueError naming it.

    Example:
        >>> import tempfile, torch
        >>> from lmcore import GPT, ModelConfig
        >>> out = tempfile.TemporaryDirectory()
        >>> _ = torch.manual_seed(0); tuned = apply_lora(GPT(ModelConfig.from_preset("tiny")), r=4)
        >>> _ = torch.nn.init.normal_(tuned.layers[0].self_attn.q_proj.lora_B)  # as if trained
        >>> path = save_lora(tuned, f"{out.name}/adapters.safetensors")
        >>> _ = torch.manual_seed(0); base = GPT(ModelConfig.from_preset("tiny"))  # the same base weights
        >>> model = load_lora(base, path)  # applies LoRA with the saved settings, then loads A and B
        >>> ids = torch.randint(0, 97, (1, 8))
        >>> model.lora_settings["r"], torch.equal(model.eval()(ids).logits, tuned.eval()(ids).logits)
        (4, True)
        >>> out.cleanup()
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if "lora_settings" not in metadata:
                raise ValueError(f"{path} has no lora_settings metadata: not a save_lora() file")
            settings = read_lora_settings(metadata["lora_settings"], path)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    except SafetensorError as exc:  # a pickle, or any other file under the name: never unpickled
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); expected adapters from save_lora") from None
    bad = _non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{path}: {bad} holds NaN or inf values: these adapters would ruin the model; use adapters "
                         "from an earlier checkpoint (a diverged fine-tune)")  # fmt: skip
    check_lora_base(model, metadata.get(BASE_METADATA), path)
    if not lora_modules(model):
        apply_lora(model, settings["targets"], settings["r"], settings["alpha"], settings["dropout"])
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model's adapters: missing {missing[:4]}, extra {unexpected[:4]}")
    with torch.no_grad():
        for key, tensor in tensors.items():
            if tensor.shape != params[key].shape:
                want = tuple(params[key].shape)
                raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, the model has {want}")
            params[key].copy_(tensor)
    return model


def check_lora_base(model: nn.Module, recorded: str | None, where: str | os.PathLike[str]) -> None:
    """Refuse (ValueError, one line) adapters recorded as trained on another base than ``model``'s; adapters that
    record no base (written before the record existed) load with a warning, and a quantized base cannot be checked.

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> _ = torch.manual_seed(0); base = GPT(ModelConfig.from_preset("tiny"))
        >>> check_lora_base(base, base_fingerprint(base), "a.safetensors")  # the same base: fine
        >>> _ = torch.manual_seed(1); other = GPT(ModelConfig.from_preset("tiny"))
        >>> check_lora_base(other, base_fingerprint(base), "a.safetensors")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: a.safetensors: these adapters were trained on another base (weights sha256 ...
    """
    if recorded is None:
        warnings.warn(f"{where}: the adapters record no base model (written by an earlier version): whether they were "
                      "trained on this base cannot be checked", stacklevel=3)  # fmt: skip
        return
    now = base_fingerprint(model)
    if now is not None and now != recorded:
        raise ValueError(
            f"{where}: these adapters were trained on another base (weights sha256 {recorded[:12]}..., this model's "
            f"{now[:12]}...): load them on the checkpoint they were fine-tuned from"
        )
