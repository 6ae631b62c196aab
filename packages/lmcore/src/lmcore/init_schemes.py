"""Initialisation schemes as plain functions, and `init_report`, a step-0 diagnostic of activations and gradients.

Every scheme sets norm weights to 1 and all biases to 0, leaves ALiBi slopes alone, and treats the
residual output projections (`o_proj`, `down_proj`) specially where the scheme says so:

- gpt2 (default): normal(0, 0.02); residual outputs normal(0, 0.02 / sqrt(2 * n_layer)) (GPT-2, Megatron).
- kaiming: kaiming_normal_(fan_in, relu), i.e. std sqrt(2 / fan_in); residual outputs divided by
  sqrt(2 * n_layer) (MPT / llm-foundry's `kaiming_normal_` with `init_div_is_residual`).
- xavier: xavier_normal_, std sqrt(2 / (fan_in + fan_out)), no residual scaling.
- small: normal(0, sqrt(2 / (5 d))) (Nguyen & Salazar 2019); residual outputs normal(0, 2 / (n_layer sqrt(d)))
  (Wang's init, as GPT-NeoX pairs them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lmcore.model import GPT

RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def _weights(model: nn.Module) -> Iterator[tuple[str, nn.Linear | nn.Embedding, bool]]:
    """(name, module, is_residual) for every Linear/Embedding weight, each shared weight once."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            yield name, module, name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS


def _reset_norms_and_biases(model: nn.Module) -> None:
    from lmcore.model import RMSNorm  # imported here: lmcore.model imports this module at its top

    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if isinstance(module, nn.LayerNorm) and module.bias is not None:  # RMSNorm has no bias
                nn.init.zeros_(module.bias)


def _n_layer(model: GPT) -> int:
    return model.config.n_layer


@torch.no_grad()
def init_gpt2(model: GPT) -> None:
    """GPT-2 / Megatron: normal(0, 0.02), residual outputs 0.02 / sqrt(2 * n_layer). Example: `init_gpt2(model)`."""
    residual_std = 0.02 / math.sqrt(2 * _n_layer(model))
    for _, module, residual in _weights(model):
        nn.init.normal_(module.weight, 0.0, residual_std if residual else 0.02)
    _reset_norms_and_biases(model)


@torch.no_grad()
def init_kaiming(model: GPT) -> None:
    """MPT: kaiming_normal_(fan_in, relu), residual outputs divided by sqrt(2 * n_layer). Example: `init_kaiming(m)`."""
    div = math.sqrt(2 * _n_layer(model))
    for _, module, residual in _weights(model):
        nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
        if residual:
            module.weight.div_(div)
    _reset_norms_and_biases(model)


@torch.no_grad()
def init_xavier(model: GPT) -> None:
    """xavier_normal_ on every weight, no residual scaling. Example: `init_xavier(model)`."""
    for _, module, _ in _weights(model):
        nn.init.xavier_normal_(module.weight)
    _reset_norms_and_biases(model)


@torch.no_grad()
def init_small(model: GPT) -> None:
    """Small init sqrt(2/(5d)) with Wang's 2/(n_layer sqrt(d)) on residual outputs. Example: `init_small(model)`."""
    d, n_layer = model.config.d_model, _n_layer(model)
    for _, module, residual in _weights(model):
        std = 2.0 / (n_layer * math.sqrt(d)) if residual else math.sqrt(2.0 / (5.0 * d))
        nn.init.normal_(module.weight, 0.0, std)
    _reset_norms_and_biases(model)


INIT_FUNCTIONS: dict[str, Callable[[GPT], None]] = {
    "gpt2": init_gpt2,
    "kaiming": init_kaiming,
    "xavier": init_xavier,
    "small": init_small,
}


def initialize(model: GPT, scheme: str) -> None:
    """Apply the scheme named `scheme` (a key of INIT_FUNCTIONS) to `model` in place."""
    if scheme not in INIT_FUNCTIONS:
        raise ValueError(f"unknown init scheme {scheme!r}; choose one of {sorted(INIT_FUNCTIONS)}")
    INIT_FUNCTIONS[scheme](model)


@dataclass
class InitReport:
    """Per-layer activation RMS (forward) and gradient norm (backward) of one batch, plus the loss."""

    loss: float
    rows: list[dict[str, float | str]] = field(default_factory=list)  # name, activation_rms, grad_norm

    def __str__(self) -> str:
        lines = [f"loss {self.loss:.4f}", f"{'module':<16} {'act_rms':>10} {'grad_norm':>10}"]
        lines += [f"{r['name']:<16} {r['activation_rms']:>10.4g} {r['grad_norm']:>10.4g}" for r in self.rows]
        return "\n".join(lines)


def init_report(model: GPT, batch: Tensor | tuple[Tensor, Tensor]) -> InitReport:
    """Measure activation RMS after the embedding, every block and the final norm, and the gradient norm of each.

    `batch` is `(inputs, targets)` or just `inputs` (then targets are the inputs shifted by one).
    Dropout is off while measuring; gradients are cleared afterwards, so it is safe to call before training.

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> report = init_report(GPT(ModelConfig.from_preset("tiny")), torch.randint(0, 97, (4, 32)))
        >>> [r["name"] for r in report.rows]
        ['embed_tokens', 'layers.0', 'layers.1', 'norm']
        >>> all(r["activation_rms"] > 0 and r["grad_norm"] > 0 for r in report.rows)
        True
    """
    if isinstance(batch, Tensor):
        targets = torch.full_like(batch, -100)
        targets[:, :-1] = batch[:, 1:]
        inputs = batch
    else:
        inputs, targets = batch
    probes: dict[str, nn.Module] = {"embed_tokens": model.embed_tokens}
    probes.update({f"layers.{i}": layer for i, layer in enumerate(model.layers)})
    probes["norm"] = model.norm
    if model.lm_head.weight is not model.embed_tokens.weight:
        probes["lm_head"] = model.lm_head
    rms: dict[str, float] = {}

    def hook(name: str):
        def record(_module, _inputs, output):
            rms[name] = output.detach().float().pow(2).mean().sqrt().item()

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in probes.items()]
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        loss = model(inputs, targets).loss
        loss.backward()
        rows: list[dict[str, float | str]] = []
        for name, module in probes.items():
            grads = [p.grad.float().pow(2).sum() for p in module.parameters() if p.grad is not None]
            grad_norm = torch.stack(grads).sum().sqrt().item() if grads else float("nan")
            rows.append({"name": name, "activation_rms": rms[name], "grad_norm": grad_norm})
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return InitReport(loss=loss.item(), rows=rows)
