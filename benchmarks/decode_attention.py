"""Regeneration's decode attention: the Triton kernel (decode/attention_kernel.py) against the batched-matmul
path, alone at one layer's shape and inside whole regeneration batches.

    python3 benchmarks/decode_attention.py --json benchmarks/results/decode-attention-h200.json

1. One layer's attention for `--rows` rows whose lengths are spread over [--min-len, --max-len] (a sorted
   batch of later-turn prompts plus the tokens decoded so far): the batched-matmul path reads every row up
   to the batch's key-length bucket, the kernel each row's own slots. Both are timed with CUDA events over
   graph-free back-to-back calls; `own_tb_s` = the rows' own K/V bytes over the time (what a perfect kernel
   moves), against the H200's ~4.3 TB/s copy rate. Kernel tile shapes are timed side by side.
2. Regeneration (benchmarks/decode_speed.py's regen_rate: 2,048 random-weight rows of 600-900-token
   prompts, 256 new tokens, no stops) with the kernel off and on, on with the fused elementwise chains
   (decode/fused_target.py), and on with compiled steps.
3. `--profile FILE`: torch.profiler tables of one prefill of the batch (the other half of regeneration's
   device time on the shipped config's data).

`--device cpu` is a check of the script, not a measurement: the kernel runs under Triton's interpreter
(TRITON_INTERPRET=1, set before anything imports triton) in float32, timed by the wall clock:

    TRITON_INTERPRET=1 python3 benchmarks/decode_attention.py --device cpu --target random:tiny --rows 4 --min-len 8 \
        --max-len 24 --regen-rows 4 --new-tokens 2 --reps 1 --no-compiled
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from functools import partial

import torch

from dflash_train.decode import attention_kernel as da
from dflash_train.decode import static_lm
from dflash_train.decode.static_lm import Mask, bucket, cached_attention

sys.path.insert(0, os.path.dirname(__file__))
from decode_speed import _prompts, regen_rate  # noqa: E402  (benchmarks/ is not a package)

DEVICE = torch.device("cuda")  # --device


def _time_ms(fn, reps: int = 20) -> float:
    fn()
    if DEVICE.type != "cuda":  # the CPU check: wall clock, no events
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()  # host sync: the events' times
    return start.elapsed_time(end) / reps


def attention_layer(rows: int, lo: int, hi: int, heads: int = 9, kv_heads: int = 3, d: int = 64,
                    reps: int = 20) -> dict:
    dev = DEVICE
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    g = torch.Generator(device=dev).manual_seed(0)
    lens = torch.sort(torch.randint(lo, hi + 1, (rows,), device=dev, generator=g)).values
    kv_len = bucket(int(lens.max()))  # host sync, once: the batched-matmul path's span
    cap = bucket(kv_len, static_lm.CACHE_BUCKET)
    q = torch.randn(rows, heads, 1, d, device=dev, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, cap, d, device=dev, dtype=dtype) for _ in range(2))
    pos = (lens - 1)[:, None]

    mask = Mask.of(torch.arange(kv_len, device=dev)[None, None, :] <= pos[:, :, None], heads // kv_heads)

    def batched():  # what StaticLM.forward does per layer: the two GEMVs and softmax (the mask made once a forward)
        return cached_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], mask, 0.125)

    own_bytes = int(lens.sum()) * kv_heads * d * 2 * q.element_size()  # K and V
    read_bytes = rows * kv_len * kv_heads * d * 2 * q.element_size()
    want = batched().float()
    out = {"rows": rows, "lengths": [lo, hi], "kv_len": kv_len, "own_gb": round(own_bytes / 1e9, 3),
           "batched_read_gb": round(read_bytes / 1e9, 3)}
    ms = _time_ms(batched, reps)
    out["batched"] = {"ms": round(ms, 4), "own_tb_s": round(own_bytes / ms / 1e9, 2),
                      "read_tb_s": round(read_bytes / ms / 1e9, 2)}
    for block, warps, stages in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3)):
        fn = partial(da.decode_attention, q, k, v, lens, 0.125, block, warps, stages)
        err = (fn().float() - want).abs().max().item()
        ms = _time_ms(fn, reps)
        out[f"kernel_b{block}_w{warps}_s{stages}"] = {"ms": round(ms, 4), "own_tb_s": round(own_bytes / ms / 1e9, 2),
                                                      "max_abs_diff": round(err, 5)}
    return out


def prefill_profile(target, prompts, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from dflash_train.decode.generate import prefill

    cuda = DEVICE.type == "cuda"
    lm = static_lm.for_model(target.model)
    cache = lm.cache_for(len(prompts), max(map(len, prompts)) + 8)
    prefill(lm, prompts, cache)
    if cuda:
        torch.cuda.synchronize()  # host sync: the warm-up's work stays out of the trace
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        prefill(lm, prompts, cache)
        if cuda:
            torch.cuda.synchronize()  # host sync: the prefill's kernels inside the trace
    with open(path, "w") as f:
        for key in ("self_cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",):
            f.write(f"== prefill of {len(prompts)} prompts by {key}\n"
                    f"{prof.key_averages().table(sort_by=key, row_limit=25)}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=600)
    ap.add_argument("--max-len", type=int, default=1100)
    ap.add_argument("--regen-rows", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--no-regen", action="store_true", help="the attention timings only")
    ap.add_argument("--no-compiled", action="store_true", help="skip regeneration with compiled steps")
    ap.add_argument("--profile", default=None, help="torch.profiler tables of one prefill of the regen batch")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per attention variant")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script under TRITON_INTERPRET=1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from dflash_train.models.loading import load_target

    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("decode_attention.py: --device cpu runs the kernel under Triton's interpreter: "
                         "set TRITON_INTERPRET=1")
    out: dict = {"device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
                 "date": date.today().isoformat(), "torch": torch.__version__,
                 "command": "python3 benchmarks/decode_attention.py "
                            + " ".join(sys.argv[1:] if argv is None else argv)}
    out["attention"] = attention_layer(args.rows, args.min_len, args.max_len, reps=args.reps)
    print("attention", json.dumps(out["attention"]), flush=True)
    if not args.no_regen:
        target = load_target(args.target, device=DEVICE)
        lo, hi = (600, 900) if DEVICE.type == "cuda" else (args.min_len, args.max_len)  # CPU: the check's lengths
        rows = _prompts(args.regen_rows, lo, hi, min(len(target.tokenizer), target.vocab_size))
        for name, kernel, fused in (("regen_batched", False, False), ("regen_kernel", True, False),
                                    ("regen_kernel_fused", True, True)):
            # a fresh engine (and graphs: captured with this path's kernels) for regeneration to use
            static_lm.use(static_lm.StaticLM(target.model, attention_kernel=kernel, fused=fused))
            out[name] = regen_rate(target, rows, args.new_tokens, hf=False)
            print(name, out[name], flush=True)
        if args.profile:
            prefill_profile(target, rows[:1024], args.profile)
        if not args.no_compiled:
            static_lm.release(target.model)
            static_lm.for_model(target.model).compile()
            try:
                out["regen_kernel_compiled"] = regen_rate(target, rows, args.new_tokens, hf=False)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                out["regen_kernel_compiled"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            print("regen_kernel_compiled", out["regen_kernel_compiled"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
