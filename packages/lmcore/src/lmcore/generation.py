"""Sampling with a KV cache: temperature, top-k, top-p, an end-of-sequence id and a seeded torch.Generator."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmcore.model import GPT, KVCache


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability reaches top_p.

    logits: (B, V). The most likely token always survives, so sampling never sees an all -inf row.

    Example:
        >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), top_k=1)
        tensor([[-inf, 3., -inf]])
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (so the first token is always kept).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: GPT,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> Tensor:
    """Continue `input_ids` (B, T) by up to `max_new_tokens` tokens; returns (B, T + n) with the prompt first.

    The prompt is encoded once and each new token costs one single-position forward over the KV cache.
    Prompts may be longer than the training context (ALiBi extrapolates). `temperature=0` is greedy.
    With `eos_id`, a row that has produced it keeps producing `eos_id`, and generation stops early once
    every row has. `seed` makes sampling reproducible through a private torch.Generator.

    The model runs in eval mode (no dropout) even when the caller left it in training mode; every module's
    mode is restored afterwards. Logits with NaN or inf (non-finite weights, a float16 overflow) raise
    ValueError naming the cause, instead of an error from the sampler; the check adds no host sync per token, so
    it fires after the last token (at the failing one when `eos_id` is set, whose check syncs anyway).

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = GPT(ModelConfig.from_preset("tiny"))
        >>> out = generate(model, torch.tensor([[1, 2, 3]]), 20, temperature=0.8, top_k=50, seed=0)
        >>> out.shape, out[0, :3].tolist()  # the prompt, then 20 new tokens
        (torch.Size([1, 23]), [1, 2, 3])
        >>> torch.equal(out, generate(model, torch.tensor([[1, 2, 3]]), 20, temperature=0.8, top_k=50, seed=0))
        True
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device)
        generator.manual_seed(seed)

    # Dropout off whatever mode the caller left the model in; each module's own flag is restored afterwards.
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        cache = KVCache(model.config.n_layer)
        out = input_ids
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
        # Set on the device and read once at the end, so the check costs no host sync per token.
        non_finite = torch.zeros((), dtype=torch.bool, device=input_ids.device)
        step_input = input_ids
        for _ in range(max_new_tokens):
            logits = model(step_input, kv_cache=cache).logits[:, -1, :].float()  # (B, V)
            bad_rows = ~torch.isfinite(logits).all(dim=-1)  # (B,)
            non_finite |= bad_rows.any()
            if temperature == 0:
                next_token = logits.argmax(dim=-1)  # (B,)
            else:
                # A NaN row would make multinomial fail (a device-side assert on CUDA) before the clear error below.
                logits = filter_logits(logits.masked_fill(bad_rows[:, None], 0.0) / temperature, top_k, top_p)
                next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)  # (B,)
            if eos_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
                finished |= next_token == eos_id
            out = torch.cat([out, next_token[:, None]], dim=1)  # (B, T + i + 1)
            if eos_id is not None and bool(finished.all() | non_finite):  # one sync per token here anyway
                break
            step_input = next_token[:, None]  # (B, 1)
        if bool(non_finite):
            raise ValueError(non_finite_message(model))
    finally:
        for module, training in modes.items():
            module.training = training
    return out


def non_finite_message(model: nn.Module) -> str:
    """Why generation stopped: the model's logits held NaN or inf, with the parameters that are not finite."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        cause = f"{len(bad)} parameter tensor(s) hold NaN or inf ({shown})"
    else:
        cause = "every parameter is finite, so an activation overflowed (float16? run in float32 or bfloat16)"
    return (
        f"generate: the model's logits contain NaN or inf: {cause}; load a checkpoint saved before the loss "
        "diverged or check the weights file"
    )
