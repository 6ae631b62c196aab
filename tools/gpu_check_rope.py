"""GPU check for rotary positions: alibi-kernels' Triton kernels with every slope 0 (how lmcore runs RoPE) against
float64 causal attention, and lmcore.from_hf models on CUDA against transformers' own on CUDA.

    ALIBI_KERNELS_AUTOTUNE=0 PYTHONPATH=packages/alibi-kernels/src:packages/lmcore/src python tools/gpu_check_rope.py

1. Kernels, forward and backward, fp32/bf16/fp16: padded (B, H, T, D) with GQA, a decoding step (one query over 513
   keys) and packed documents (varlen). The rule of the repository's kernel tests (FlashAttention's): the error
   against float64 is at most twice PyTorch's own same-dtype SDPA error plus 1e-5 (fp32: within 1e-4 outright).
2. Models: tiny random Llama, Qwen2 and Mistral checkpoints written by transformers (hidden 256, 4 layers, 8 query
   and 2 key/value heads), read by `lmcore.from_hf` onto the GPU (Triton attention) and by transformers (its SDPA):
   fp32 logits (TF32 off) within 1e-4, and 20 greedy tokens with the KV cache equal; bf16 logits' error against the
   fp32 ones no more than twice transformers' bf16 error plus 1e-2.

Prints one line per check and exits 1 when any fails, 2 without CUDA.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "lmcore" / "tests"))  # hf_checkpoints: the tests' checkpoint writer
FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def reference(q, k, v, causal_offset: int = 0):
    """float64 causal attention with GQA by repetition; queries aligned to the end of the keys."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    tq, tk = q.shape[2], k.shape[2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check_kernels() -> None:
    from alibi_kernels import alibi_attention, alibi_attention_varlen

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 8, 2, 512, 64, 512), (1, 12, 4, 1024, 128, 1024), (2, 9, 3, 1, 64, 513)]  # B, H, Hkv, Tq, D, Tk
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for b, h, hkv, tq, d, tk in shapes:
            q = torch.randn(b, h, tq, d, device="cuda", generator=g)
            k, v = (torch.randn(b, hkv, tk, d, device="cuda", generator=g) for _ in range(2))
            dout = torch.randn(b, h, tq, d, device="cuda", generator=g)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            ref = reference(q64, k64, v64)
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
            results = {}
            for name in ("triton", "sdpa"):
                qx, kx, vx = (t.to(dtype).requires_grad_() for t in (q, k, v))
                if name == "triton":
                    out = alibi_attention(qx, kx, vx, torch.zeros(h, device="cuda"), backend="triton")
                else:
                    out = reference(qx, kx, vx)
                grads = torch.autograd.grad(out, (qx, kx, vx), dout.to(dtype))
                errors = [(out.double() - ref).abs().max().item()]
                errors += [(gx.double() - gr).abs().max().item() for gx, gr in zip(grads, ref_grads, strict=True)]
                results[name] = errors
            ours, torch_err = results["triton"], results["sdpa"]
            bound = [1e-4] * 4 if dtype == torch.float32 else [2 * t + 1e-5 for t in torch_err]
            ok = all(o <= bnd for o, bnd in zip(ours, bound, strict=True))
            detail = "out/dq/dk/dv max err " + " ".join(f"{e:.1e}" for e in ours)
            detail += " (SDPA same dtype: " + " ".join(f"{e:.1e}" for e in torch_err) + ")"
            report(f"zero-slope kernel {str(dtype)[6:]} B{b} H{h}/{hkv} Tq{tq} Tk{tk} D{d}", ok, detail)
    # Packed documents: each document attends to itself only.
    cu = torch.tensor([0, 100, 100, 350, 512], device="cuda", dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(512, 8, 64, device="cuda", generator=g)
        k, v = (torch.randn(512, 2, 64, device="cuda", generator=g) for _ in range(2))
        out = alibi_attention_varlen(q.to(dtype), k.to(dtype), v.to(dtype), cu, 250, torch.zeros(8, device="cuda"),
                                     backend="triton")  # fmt: skip
        parts = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            if e > s:
                parts.append(reference(*(t[s:e].transpose(0, 1)[None].double() for t in (q, k, v)))[0].transpose(0, 1))
        err = (out.double() - torch.cat(parts)).abs().max().item()
        limit = 1e-4 if dtype == torch.float32 else 2e-2
        report(f"zero-slope varlen kernel {str(dtype)[6:]} (documents 100, 0, 250, 162)", err <= limit, f"{err:.1e}")


def check_models() -> None:
    import transformers
    from hf_checkpoints import random_hf

    import lmcore

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=512)  # fmt: skip
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        with tempfile.TemporaryDirectory() as d:
            hf = random_hf(arch, seed=1, **shape)
            with torch.no_grad():
                hf.lm_head.weight.mul_(10)  # decisive greedy choices
            hf.save_pretrained(d)
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
            ours = lmcore.from_hf(d, device="cuda")
            ids = torch.randint(0, 1000, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
            with torch.no_grad():
                theirs, mine = hf(ids).logits, ours(ids).logits
            err = (theirs - mine).abs().max().item()
            report(f"{arch} fp32 logits on CUDA (Triton) vs transformers", err <= 1e-4, f"max |diff| {err:.1e}")
            prompt = ids[:, :12]
            hf.generation_config.eos_token_id = None
            hf.generation_config.pad_token_id = 0
            tokens = hf.generate(prompt, max_new_tokens=20, do_sample=False)
            same = tokens.tolist() == lmcore.generate(ours, prompt, 20, temperature=0).tolist()
            report(
                f"{arch} 20 greedy tokens with the KV cache vs transformers.generate",
                same,
                "equal" if same else "differ",
            )
            hf16 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
            ours16 = lmcore.from_hf(d, dtype=torch.bfloat16, device="cuda")
            with torch.no_grad():
                e_theirs = (hf16(ids).logits.double() - theirs.double()).abs().max().item()
                e_ours = (ours16(ids).logits.double() - theirs.double()).abs().max().item()
            report(f"{arch} bf16 logits' error vs fp32", e_ours <= 2 * e_theirs + 1e-2,
                   f"lmcore {e_ours:.2e}, transformers {e_theirs:.2e}")  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check_rope: no CUDA device visible to torch")
        return 2
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    check_kernels()
    check_models()
    print(f"{len(FAILED)} failed; {time.perf_counter() - start:.0f} s")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
