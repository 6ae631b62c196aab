"""No device-to-host read in a training step or a decoding step on CUDA, checked on CPU.

A GPU can only be stalled by a host read; this machine has none, so the tests emulate what
`torch.cuda.set_sync_debug_mode("error")` reports: a TorchDispatchMode records every aten op that needs the
values on the host (`_local_scalar_dense`, behind `item()`, `int()`, `bool()`; ops whose output shape depends on
the values: `nonzero`, `masked_select`, boolean-mask indexing, `unique`, `repeat_interleave` without a size;
`equal`, `is_nonzero`), and `Tensor.tolist`, `numpy`, `__array__`, `cpu` and `to("cpu")`, which bypass the
dispatcher, are patched to record too. `GPT.forward` is steered onto its CUDA branch by patching the one function
that picks the branch from the device, and the attention core, which on CUDA is alibi-kernels' Triton kernel (no
host read on its padded path), is replaced by an SDPA stand-in with the bias built on the device, checked against
the real one. The first test shows the recorder catching each kind of host read, the check `GPT.forward` made
before among them. Document attention on the torch path is checked too; on the Triton path its varlen offsets
cost one documented host read per forward.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lmcore.model
from lmcore import GPT, KVCache, ModelConfig

aten = torch.ops.aten
VALUE_READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
    aten.is_nonzero,
}


class HostReads(TorchDispatchMode):
    """Records the ops that would make the host wait for a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        bool_index = packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        )
        repeats_tensor = func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
        if packet in VALUE_READS or bool_index or (repeats_tensor and kwargs.get("output_size") is None):
            self.reads.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(monkeypatch):
    """Yield the list of host reads made inside the block."""
    mode = HostReads()

    def recording(name, original):
        def method(self, *args, **kwargs):
            mode.reads.append(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return method

    def to(self, *args, **kwargs):
        targets = [*args, kwargs.get("device")]
        if any(str(t) == "cpu" or (isinstance(t, torch.device) and t.type == "cpu") for t in targets):
            mode.reads.append("Tensor.to(cpu)")
        return original_to(self, *args, **kwargs)

    original_to = torch.Tensor.to
    with monkeypatch.context() as patch:
        for name in ("tolist", "numpy", "__array__", "cpu"):
            patch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
        patch.setattr(torch.Tensor, "to", to)
        with mode:
            yield mode.reads


def device_alibi_attention(q, k, v, slopes, *, causal=True, backend="auto", document_starts=None):
    """ALiBi attention with the bias built on the inputs' device: the stand-in for the Triton kernel."""
    assert document_starts is None  # a model with documents takes varlen on the Triton path
    tq, tk = q.shape[2], k.shape[2]
    distance = torch.arange(tk - tq, tk)[:, None] - torch.arange(tk)[None, :]  # (Tq, Tk): query pos - key pos
    bias = -slopes[:, None, None] * distance  # (H, Tq, Tk)
    bias = bias.masked_fill(distance < 0, float("-inf")).to(q.dtype)
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # (B, H, Tk, D)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.fixture
def device_attention(monkeypatch):
    monkeypatch.setattr(lmcore.model, "alibi_attention", device_alibi_attention)


@pytest.fixture
def cuda_branch(monkeypatch, device_attention):
    """GPT.forward takes the path it takes on CUDA, with the stand-in attention core."""
    monkeypatch.setattr(lmcore.model, "_ids_checked_on_host", lambda device: False)


def test_the_stand_in_attention_matches_alibi_kernels(monkeypatch):
    model = tiny(n_kv_head=2).eval()
    expected = model(IDS).logits
    monkeypatch.setattr(lmcore.model, "alibi_attention", device_alibi_attention)
    torch.testing.assert_close(model(IDS).logits, expected, rtol=1e-5, atol=1e-5)
    cache = KVCache(model.config.n_layer)
    model(IDS[:, :-1], kv_cache=cache)
    torch.testing.assert_close(model(IDS[:, -1:], kv_cache=cache).logits[:, 0], expected[:, -1], rtol=1e-5, atol=1e-5)


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig.from_preset("tiny", attention_backend="torch", **overrides))


IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "read",
    [
        lambda x: [int(v) for v in torch.aminmax(x)],  # the id check GPT.forward made before
        lambda x: x.max().item(),
        lambda x: bool((x > 3).all()),
        lambda x: float(x.float().mean()),
        lambda x: x.tolist(),
        lambda x: x.numpy(),
        lambda x: x.cpu(),
        lambda x: x.to("cpu"),
        lambda x: x.nonzero(),
        lambda x: x[x > 3],
        lambda x: torch.unique(x),
        lambda x: torch.repeat_interleave(x.flatten()[:3]),
        lambda x: torch.equal(x, x),
    ],
)
def test_the_recorder_catches_each_kind_of_host_read(monkeypatch, read):
    with host_reads(monkeypatch) as reads:
        read(IDS)
    assert reads


def test_the_recorder_sees_the_id_check_on_cpu(monkeypatch, device_attention):
    model = tiny()
    with host_reads(monkeypatch) as reads:
        model(IDS)
    assert reads == ["aten._local_scalar_dense.default"] * 2  # low and high of the range check


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(dropout=0.1),
        dict(checkpointing="attention", dropout=0.1),
        dict(checkpointing="block", dropout=0.1),
        dict(n_kv_head=2, activation="swiglu", norm="rmsnorm", learnable_slopes=True, bias=False),
        dict(position="rope", n_kv_head=2, activation="swiglu", norm="rmsnorm", bias=False, qkv_bias=True),
    ],
)
def test_a_training_step_makes_no_host_read_on_cuda(monkeypatch, cuda_branch, overrides):
    model = tiny(**overrides)
    labels = IDS.clone()
    labels[0, :3] = -100
    with host_reads(monkeypatch) as reads:
        model(IDS, labels).loss.backward()
    assert reads == []
    assert model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides", [dict(), dict(position="rope", rope_scaling="dynamic", rope_factor=2.0)])
def test_cached_decoding_makes_no_host_read_on_cuda(monkeypatch, cuda_branch, overrides):
    model = tiny(**overrides).eval()
    cache = KVCache(model.config.n_layer)
    with host_reads(monkeypatch) as reads, torch.no_grad():
        model(IDS, kv_cache=cache)
        model(IDS[:, :1], kv_cache=cache)
    assert reads == []


@pytest.mark.parametrize("bad", [97, -1])
def test_the_device_side_check_still_rejects_out_of_range_ids(cuda_branch, bad):
    # On CPU torch._assert_async raises at once; on CUDA the same message comes with the device-side assert.
    with pytest.raises(RuntimeError, match=r"outside \[0, vocab_size=97\)"):
        tiny()(torch.tensor([[1, bad]]))


@pytest.fixture
def cuda_ids_branch(monkeypatch):
    """GPT.forward's id check as on CUDA (asynchronous), with alibi-kernels' real torch path for attention."""
    monkeypatch.setattr(lmcore.model, "_ids_checked_on_host", lambda device: False)


def test_the_torch_path_reads_the_slopes_once_then_never(monkeypatch, cuda_ids_branch):
    from alibi_kernels import clear_bias_cache

    clear_bias_cache()
    model = tiny().eval()
    with host_reads(monkeypatch) as first, torch.no_grad():
        expected = model(IDS).logits
    with host_reads(monkeypatch) as later, torch.no_grad():
        model(IDS)
        model(IDS[:, :5])  # another length: a new bias from the slopes' values already read
    assert first == ["Tensor.tolist"] * model.config.n_layer  # each layer's slopes buffer, once
    assert later == []
    # An in-place change of the slopes is a new version: read again, and the bias follows it.
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.slopes.mul_(4)
    changed = model(IDS).logits
    clear_bias_cache()
    torch.testing.assert_close(model(IDS).logits, changed)
    assert not torch.allclose(changed, expected)


@pytest.mark.parametrize("overrides", [dict(), dict(position="rope", n_kv_head=2, checkpointing="block")])
def test_document_attention_on_the_torch_path_makes_no_host_read(monkeypatch, cuda_ids_branch, overrides):
    """The torch path takes the documents as starts (B, T): masks built on the device, no offsets read."""
    model = tiny(document_separator=3, **overrides)
    ids = IDS.clone()
    ids[:, 4] = 3  # every row cut into two documents
    model(ids, ids).loss.backward()  # the first call reads each layer's slopes (the test above)
    model.zero_grad()
    with host_reads(monkeypatch) as reads:
        model(ids, ids).loss.backward()
    assert reads == []
