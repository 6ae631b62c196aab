"""`compile_model`: the model under `torch.compile`, as one graph (the forward makes no host read).

Nothing in `GPT.forward` leaves the graph: the ALiBi bias is built inside it (alibi-kernels' torch path skips its
Python cache while compiling), and the token-id check is `torch._assert_async`, an op of the graph, instead of the
eager CPU path's host read. A CPU test holds it to zero graph breaks (`torch._dynamo.explain`) and to eager's
results (tests/test_compile.py).

On the CPU compiling stays off by default (docs/benchmarks.md, "A training step at the machine's limit"): on the
2-core test machine a compiled fp32 cpu-small step measured 1.00-1.04x eager's speed, nothing to gain; with bf16
autocast 1.20-1.27x eager bf16's, but compiling (cold inductor cache) the fp32 and the bf16 step took 82-98 s wall
together at load 4-5, against a 260 s headline budget (8 s from a warm cache). On a GPU it is the usual lever;
nothing here measured it there.

Ids out of range raise a RuntimeError naming the vocabulary when the compiled graph runs (the assert). Labels out
of range are not checked in the graph: inductor's own bounds check in the CPU loss kernel then stops the process.
Check token files once when they are opened (lmtrain does) or call `lmcore.check_token_ids`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

__all__ = ["compile_model"]

M = TypeVar("M", bound=nn.Module)


def compile_model(model: M, *, fullgraph: bool = True, **options: Any) -> M:
    """Compile `model` in place (`nn.Module.compile`) and return it: the same object, so its state_dict keys, its
    attributes (`flops_per_token`, `config`) and checkpoints stay as they are.

    `fullgraph=True` makes a graph break an error instead of a silent fallback to eager; `options` go to
    `torch.compile` (`mode`, `dynamic`, `backend`). Compilation happens at the first call, and again when the
    input shapes change (a second sequence length makes torch mark the length dynamic).

    Example:
        >>> import torch
        >>> from lmcore import GPT, ModelConfig
        >>> model = compile_model(GPT(ModelConfig.from_preset("tiny")), backend="eager")  # backend: a quick doctest
        >>> ids = torch.randint(0, 97, (2, 8))
        >>> model(ids, ids).loss.ndim, sorted(model.state_dict())[0]
        (0, 'embed_tokens.weight')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_model needs an nn.Module, got {type(model).__name__}")
    if not isinstance(fullgraph, bool):
        raise TypeError(f"fullgraph must be a bool, got {fullgraph!r}")
    model.compile(fullgraph=fullgraph, **options)
    return model
