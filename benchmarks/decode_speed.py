"""Decode-loop speeds of a target: regeneration (batched), batch-1 target-only and DFlash decoding.

Each figure is measured for the StaticLM path (static KV cache, CUDA graphs) and for the HF
forward it replaced, in one process on one device:

    python3 benchmarks/decode_speed.py --target random:smollm2-135m --json benchmarks/results/decode-h200.json

Random weights never emit a stop token, so every row decodes the full --new-tokens: tokens/s
counts real work. DFlash decoding is reported per verify step (a random drafter accepts ~0
drafts); `break_even_tau` = DFlash step time / target-only token time is the acceptance
length at which DFlash decoding starts to pay off, and speedup = tau / break_even_tau. The DFlash
step is timed three ways: the T=0 loop with its state on the device (what eval runs), the host
loop (a sync per step: what T>0 runs) and the device loop's steps back to back (the GPU's share).
`--compile` measures batch-1 target-only and DFlash decoding once more with both decoders'
steps compiled (`compile_decode`, what `eval --compile` runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date

import torch

from dflash_train.data import regenerate as regen
from dflash_train.data.regenerate import RegenConfig, RegenReport
from dflash_train.decode import greedy_loop, static_lm
from dflash_train.decode import speculative as spec
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # host sync: honest wall time


def _prompts(n, lo, hi, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def regen_rate(target, prompts, new_tokens, hf: bool, temperature: float = 0.0) -> dict:
    cfg = RegenConfig(max_new_tokens=new_tokens, batch_size=len(prompts), temperature=temperature)

    def decode(rows, c, report=None):  # the generated tokens of every row (no stop tokens: all run to the limit)
        if hf:
            return regen._hf_generate(target, rows, c, [])
        return [row for _, batch in regen._decoded_batches(target, rows, c, [], report) for row in batch]

    decode(prompts[:8], RegenConfig(max_new_tokens=4))  # warm-up: kernels, cuBLAS handles
    _sync(target.device)
    split = RegenReport(written=0, already_done=0, generated_tokens=0, seconds=0.0, hit_length_limit=0)
    t0 = time.perf_counter()
    rows = decode(prompts, cfg, split)
    _sync(target.device)
    secs = time.perf_counter() - t0
    tokens = sum(map(len, rows))
    out = {"rows": len(prompts), "new_tokens": new_tokens, "generated": tokens, "seconds": round(secs, 3),
           "tokens_per_s": round(tokens / secs, 1)}
    if split.prefill_s:  # StaticLM: prompts prefilled, then decode steps (each row's first token is the prefill's)
        out.update(prompt_tokens=split.prompt_tokens, prefill_s=round(split.prefill_s, 3),
                   decode_s=round(split.decode_s, 3),
                   decode_tokens_per_s=round((tokens - len(prompts)) / split.decode_s, 1))
    return out


def batch1_rate(target, prompts, new_tokens, hf: bool) -> dict:
    fn = spec.hf_target_generate if hf else spec.target_generate
    fn(target, prompts[0], new_tokens)  # warm-up (graph captures for every bucket)
    runs = [fn(target, p, new_tokens) for p in prompts]
    toks = sum(len(r.tokens) - 1 for r in runs)
    secs = sum(r.decode_s for r in runs)
    return {"prompts": len(prompts), "tokens_per_s": round(toks / secs, 1), "ms_per_token": round(1e3 * secs / toks, 3)}


def dflash_rate(target, drafter, prompts, new_tokens, hf: bool, monkey=None, device_loop=True) -> dict:
    if monkey:
        monkey()
    spec.speculative_generate(target, drafter, prompts[0], new_tokens, device_loop=device_loop)  # warm-up
    runs = [spec.speculative_generate(target, drafter, p, new_tokens, device_loop=device_loop) for p in prompts]
    steps = sum(len(r.committed) for r in runs)
    secs = sum(r.decode_s for r in runs)
    taus = [sum(r.committed) / len(r.committed) for r in runs]
    return {"prompts": len(prompts), "ms_per_step": round(1e3 * secs / steps, 3),
            "tau": round(statistics.mean(taus), 3)}


def device_steps(target, drafter, prompt, steps: int = 64) -> dict:
    """The device loop's steps back to back with no host sync between them: the GPU's time per step."""
    loop = greedy_loop.for_pair(target, drafter)
    kv = static_lm.bucket(len(prompt) + (steps + 2) * drafter.block_size)
    for _ in range(2):  # the first round captures the graph
        loop.start(prompt, steps * drafter.block_size)
        loop.first_step()
        _sync(target.device)
        t0 = time.perf_counter()
        loop.advance(steps, kv)
        _sync(target.device)
        secs = time.perf_counter() - t0
    return {"steps": steps, "ms_per_step": round(1e3 * secs / steps, 3)}


def _profile(target, drafter, rows, prompt, path):
    """Top ops by device and host time: a regen batch of 32 new tokens, then 16 DFlash steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    regen_rate(target, rows, 32, hf=False)
    spec.speculative_generate(target, drafter, prompt, 32)
    with open(path, "w") as f:
        for name, fn in (("regen", lambda: regen_rate(target, rows, 32, hf=False)),
                         ("dflash", lambda: spec.speculative_generate(target, drafter, prompt,
                                                                      16 * drafter.block_size))):
            with profile(activities=acts) as prof:
                fn()
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                f.write(f"== {name} by {key}\n{prof.key_averages().table(sort_by=key, row_limit=18)}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--regen-rows", type=int, default=1024, help="prompts decoded together by the StaticLM path")
    ap.add_argument("--regen-hf-rows", type=int, default=256, help="prompts decoded together by the HF path")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="measure the StaticLM path only")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="regeneration's sampling temperature (0: greedy; > 0 draws through decode/sampling.py)")
    ap.add_argument("--compile", action="store_true", help="also measure batch-1 decoding with compiled steps")
    ap.add_argument("--profile", default=None,
                    help="write torch.profiler tables of a regen batch and DFlash steps here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    target = load_target(args.target, device=dev)
    vocab = min(len(target.tokenizer), target.vocab_size)
    rows = _prompts(args.regen_rows, args.prompt_min, args.prompt_max, vocab)
    few = _prompts(args.batch1_prompts, args.prompt_min, args.prompt_max, vocab, seed=1)
    drafter = new_drafter(drafter_config_for(target, num_layers=args.draft_layers, block_size=args.block_size), 0,
                          dev).to(target.dtype).eval()
    out: dict = {"target": args.target, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                 platform.processor() or "cpu", "date": date.today().isoformat(), "torch": torch.__version__,
                 "command": "python3 benchmarks/decode_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.profile:
        _profile(target, drafter, rows[:1024], few[0], args.profile)
    out["regen_static"] = regen_rate(target, rows, args.new_tokens, hf=False, temperature=args.temperature)
    print("regen static", out["regen_static"], flush=True)
    out["batch1_static"] = batch1_rate(target, few, args.new_tokens, hf=False)
    print("batch1 static", out["batch1_static"], flush=True)
    out["dflash_static"] = dflash_rate(target, drafter, few, args.new_tokens, hf=False)
    print("dflash static (device loop)", out["dflash_static"], flush=True)
    out["dflash_static_host_loop"] = dflash_rate(target, drafter, few, args.new_tokens, hf=False, device_loop=False)
    print("dflash static, host loop (a sync per step)", out["dflash_static_host_loop"], flush=True)
    out["dflash_static_gpu_only"] = device_steps(target, drafter, few[0])
    print("dflash static, steps back to back", out["dflash_static_gpu_only"], flush=True)
    if args.compile:
        spec.compile_decode(target, drafter)
        out["batch1_compiled"] = batch1_rate(target, few, args.new_tokens, hf=False)
        print("batch1 compiled", out["batch1_compiled"], flush=True)
        out["dflash_compiled"] = dflash_rate(target, drafter, few, args.new_tokens, hf=False)
        print("dflash compiled (device loop)", out["dflash_compiled"], flush=True)
        out["dflash_compiled_gpu_only"] = device_steps(target, drafter, few[0])
        print("dflash compiled, steps back to back", out["dflash_compiled_gpu_only"], flush=True)
    if not args.skip_hf:
        out["regen_hf"] = regen_rate(target, rows[:args.regen_hf_rows], min(args.new_tokens, 64), hf=True)
        print("regen hf", out["regen_hf"], flush=True)
        out["batch1_hf"] = batch1_rate(target, few[:2], min(args.new_tokens, 64), hf=True)
        print("batch1 hf", out["batch1_hf"], flush=True)
        saved = static_lm.for_model
        try:
            out["dflash_hf"] = dflash_rate(target, drafter, few[:2], min(args.new_tokens, 64), hf=True,
                                           monkey=lambda: setattr(static_lm, "for_model", lambda model: None))
        finally:
            static_lm.for_model = saved
        print("dflash hf", out["dflash_hf"], flush=True)
    for path in ("static", "compiled", "hf"):
        if f"batch1_{path}" in out:
            step, tok = out[f"dflash_{path}"]["ms_per_step"], out[f"batch1_{path}"]["ms_per_token"]
            out[f"break_even_tau_{path}"] = round(step / tok, 3)
    if peak := (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0):
        out["peak_memory_gb"] = round(peak / 1e9, 2)
    print(f"\n{'path':8} {'regen tok/s':>12} {'batch-1 tok/s':>14} {'dflash ms/step':>15} {'break-even tau':>15}")
    for path in ("static", "compiled", "hf"):
        if f"batch1_{path}" in out:
            regen = f"{out[f'regen_{path}']['tokens_per_s']:,.0f}" if f"regen_{path}" in out else "-"
            print(f"{path:8} {regen:>12} {out[f'batch1_{path}']['tokens_per_s']:>14,.1f} "
                  f"{out[f'dflash_{path}']['ms_per_step']:>15.2f} {out[f'break_even_tau_{path}']:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
