"""Greedy decoding of the custom-code Hugging Face export (`lmcore.hf_custom`, `trust_remote_code=True`) with its
KV cache against without it (`use_cache=False`: the whole sequence recomputed for every token), and against
`lmcore.generate` on the same model, in one process, interleaved repetitions; the tokens are checked equal.

Prints seconds per call (medians) and the ratios `custom_cached_vs_uncached` (uncached time / cached time: > 1, the
cache is faster) and `custom_cached_vs_lmcore` (lmcore.generate's time / the export's: 1.0 = no overhead).
Needs the hf extra (transformers).

    python benchmarks/bench_custom_generate.py [--preset cpu-small] [--prompt 32] [--new 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="tokens generated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import transformers

    from lmcore import GPT, ModelConfig, generate
    from lmcore.hf_custom import save_custom

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_preset(args.preset)).eval()
    work = tempfile.TemporaryDirectory()
    save_custom(model, work.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(work.name, trust_remote_code=True).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt))
    n = args.new
    calls = {
        "custom, cached": lambda: hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False),
        "custom, use_cache=False": lambda: hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=False
        ),
        "lmcore.generate": lambda: generate(model, prompt, n, temperature=0),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    outputs = {}
    with torch.no_grad():
        for _ in range(args.reps):
            for name, call in calls.items():
                start = time.perf_counter()
                outputs[name] = call().tolist()
                times[name].append(time.perf_counter() - start)
    same = len({str(out) for out in outputs.values()}) == 1
    print(f"{args.preset}: prompt {args.prompt}, {n} new tokens, {args.threads} thread(s), {args.reps} repetitions")
    print("| call | s per call (median) |\n| --- | --- |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} |")
    cached = statistics.median(times["custom, cached"])
    print(f"tokens equal in all three: {same}")
    print(f"custom_cached_vs_uncached: {statistics.median(times['custom, use_cache=False']) / cached:.2f}")
    print(f"custom_cached_vs_lmcore: {statistics.median(times['lmcore.generate']) / cached:.2f}")
    work.cleanup()


if __name__ == "__main__":
    main()
