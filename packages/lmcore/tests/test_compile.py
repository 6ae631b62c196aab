"""The compile path: GPT traces as one graph (no break: no host read in the forward), and the compiled model
(inductor, fullgraph=True) trains like eager on the CPU."""

import os
import shutil

import pytest
import torch

from lmcore import GPT, ModelConfig
from lmcore.compiled import compile_model

# Inductor's CPU backend compiles C++ (its default compiler is g++, else c++).
needs_cxx = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="inductor's CPU backend needs a C++ compiler (g++)"
)
IDS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny", attention_backend="torch", **overrides))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Inductor's CPU kernels open an OpenMP region each; on a loaded 2-core machine two threads wait at every
    # barrier (a tiny step measured 0.5 s of CPU time at 2 threads, 3 ms at 1).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "overrides, train",
    [
        (dict(dropout=0.1), True),
        (dict(n_kv_head=2, activation="swiglu", norm="rmsnorm", bias=False), True),
        (dict(), False),
        (dict(position="rope", rope_scaling="llama3", rope_factor=8.0, qkv_bias=True, bias=False), True),  # Qwen2-like
    ],
)
def test_dynamo_sees_one_graph_and_no_break(overrides, train):
    model = tiny(**overrides).train(train)
    labels = IDS if train else None
    explained = torch._dynamo.explain(model)(IDS, labels)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    # explain does not count every break (a host read inside a generator expression went uncounted): fullgraph
    # tracing fails on any.
    torch._dynamo.reset()
    torch.compile(model, backend="eager", fullgraph=True)(IDS, labels)


@pytest.fixture(scope="module")
def compiled_pair():
    """An eager model and a same-weights copy compiled with inductor, fullgraph=True: one compilation per module."""
    torch._dynamo.reset()
    eager = tiny()
    compiled = tiny()
    compile_model(compiled)
    compiled(IDS, IDS.clone()).loss.backward()  # compiles forward and backward once (labels not the ids object:
    # dynamo guards on that aliasing, and the tests pass two tensors)
    compiled.zero_grad(set_to_none=True)
    return eager, compiled


@needs_cxx
def test_compiled_training_step_matches_eager(compiled_pair):
    eager, compiled = compiled_pair
    labels = IDS.clone()
    labels[0, :4] = -100
    losses = []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        loss = model(IDS, labels).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    # Against the largest gradient of all: some are zero up to rounding (k_proj's bias adds a constant to each row
    # of scores, which the softmax removes), so their own scale is noise.
    scale = max(p.grad.abs().max().item() for p in eager.parameters())
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=0, atol=1e-5 * scale, msg=name)


@needs_cxx
def test_compiled_graph_still_rejects_out_of_range_ids(compiled_pair):
    _, compiled = compiled_pair
    bad = IDS.clone()
    bad[1, 3] = 97
    with pytest.raises(RuntimeError, match=r"outside \[0, vocab_size=97\)"):
        compiled(bad, IDS)


def test_compile_model_keeps_the_object_and_its_state_dict_keys():
    model = tiny()
    keys = list(model.state_dict())
    assert compile_model(model, backend="eager") is model
    assert list(model.state_dict()) == keys
    assert model(IDS, IDS).loss.ndim == 0


def test_compile_model_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="needs an nn.Module, got function"):
        compile_model(lambda x: x)


DOCUMENT_IDS = IDS.clone()
DOCUMENT_IDS[0, 5], DOCUMENT_IDS[1, 9] = 3, 3  # two rows, each cut into two documents by the separator 3


def _one_graph(model: GPT, ids: torch.Tensor) -> None:
    """Trace the training forward with fullgraph=True (any graph break is an error) and count graphs."""
    labels = ids.clone()
    torch.compile(model, backend="eager", fullgraph=True)(ids, labels)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize(
    "extra",
    [{}, {"document_separator": 3}, {"document_separator": 3, "position": "rope"}],
    ids=["dense", "documents", "documents-rope"],
)
def test_the_torch_attention_path_is_one_graph(extra):
    model = tiny(**extra).train()
    _one_graph(model, DOCUMENT_IDS)


def test_compiled_document_attention_trains_as_the_eager_model():
    """aot_eager traces the forward and the backward into graphs: the loss and every gradient equal eager's."""
    torch.manual_seed(0)
    eager = tiny(document_separator=3, dropout=0.0).train()
    compiled = tiny(document_separator=3, dropout=0.0).train()
    compiled.load_state_dict(eager.state_dict())
    losses = []
    for model in (eager, torch.compile(compiled, backend="aot_eager", fullgraph=True)):
        loss = model(DOCUMENT_IDS, DOCUMENT_IDS).loss
        loss.backward()
        losses.append(loss.detach())
    torch._dynamo.reset()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


# The Triton path is one custom operator per direction (alibi_kernels.attention_triton): dynamo records it as one
# node and never traces the launch code, so the model traces whole on the CPU under TRITON_INTERPRET (the kernels run
# when the graph runs) and on a GPU (tools/gpu_check.sh's gpu-tests part).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = pytest.mark.triton
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 (the nox session sets it)",
)


@triton
@needs_triton
@pytest.mark.parametrize(
    "extra",
    [{}, {"document_separator": 3}, {"document_separator": 3, "position": "rope"}],
    ids=["dense", "documents", "documents-rope"],
)
def test_the_triton_attention_path_is_one_graph(extra):
    model = GPT(ModelConfig.from_preset("tiny", attention_backend="triton", **extra)).to(TRITON_DEVICE).train()
    _one_graph(model, DOCUMENT_IDS.to(TRITON_DEVICE))


@triton
@needs_triton
def test_compiled_triton_document_attention_trains_as_the_eager_model():
    """aot_eager, forward and backward, on the Triton path with documents: the loss and every gradient equal eager's
    (the same kernels run either way)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        config = ModelConfig.from_preset("tiny", attention_backend="triton", document_separator=3, dropout=0.0)
        models.append(GPT(config).to(TRITON_DEVICE).train())
    ids = DOCUMENT_IDS.to(TRITON_DEVICE)
    losses = []
    for model in (models[0], torch.compile(models[1], backend="aot_eager", fullgraph=True)):
        loss = model(ids, ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch._dynamo.reset()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
