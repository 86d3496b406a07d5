"""Where a batch-1 DFlash step's time goes: each part's graph replayed back to back, eager and compiled.

    python3 benchmarks/decode_parts.py --draft-layers 5 --json benchmarks/results/decode-parts-h200.json
    python3 benchmarks/decode_parts.py --draft-layers 12 --block-size 8 --sliding-layers 1 --intermediate-size 3072
                                                  # the SmolLM2 recipe's drafter (configs/smollm2-h200.toml)

Parts: the target's one-token step (the baseline's unit), its B-token verify (logits and
features), the drafter's step, and the whole T=0 device-loop step (draft, verify, accept).
Each is captured as a CUDA graph and replayed `--reps` times with no host sync in between, so
the figure is the GPU's time (kernels and the gaps between them), not Python's. `kernels` counts
the kernels one eager call launches (torch.profiler): at batch 1 a small model's step costs about
its kernel count times a few microseconds. The whole step is replayed in place: each replay
puts the loop's state back (seven small copies, counted in its figure), so every replay drafts
and verifies at the same position in a cache sized as eval sizes it. `--compile` also times each part through
torch.compile as `eval --compile` runs it (`compile_decode`: the target's and the drafter's
forwards compiled apiece, over the whole cache; the graph capture stays ours).

`--without LEVER` (repeatable) times the step with one of the fast path's levers turned off, to measure
what each buys with the others in place: `pack` (the drafter's stacked q/k/v and gate/up), `target-pack`
(the target's), `split` (span attention a program a key tile), `accept` (the device loop's acceptance as one
kernel); with DFLASH_TRAIN_SPLIT_REDUCE=1 (decode/arrivals.py), `merge` (those tiles' sums merged by the split
kernel's last program instead of a second kernel), `tails` (the drafter's o_proj and down_proj each one kernel
with the residual add and norm after them), `target-tails` (the target's) and `project` (both engines' q/k/v
GEMM with its q/k norms, RoPE and K/V writes as one kernel, where the tails run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date

import torch

from dflash_train.decode import (
    graphs,
    greedy_accept,
    greedy_loop,
    linear_rope,
    span_attention,
    static_drafter,
    static_lm,
)
from dflash_train.decode.graphs import GraphStore
from dflash_train.decode.speculative import compile_decode
from dflash_train.models.factory import drafter_config_for, new_drafter
from dflash_train.models.loading import load_target

DEVICE = torch.device("cuda")


def _time(fn, reps: int) -> float:
    """ms per call of fn() replayed as a graph (no inputs: it reads fixed buffers)."""
    store, dummy = GraphStore(), torch.zeros(1, device=DEVICE)
    run = (lambda: graphs.replay(store, "k", fn, dummy)) if DEVICE.type == "cuda" else (lambda: fn(dummy))
    run()  # warm-up (and capture)
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    _sync()
    return round(1e3 * (time.perf_counter() - t0) / reps, 4)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # host sync: honest wall time


def _kernels(fn, top: int = 0) -> tuple[int, list[tuple[str, int, float]]]:
    """The kernels one eager call of fn launches, and the `top` kernel names by their summed GPU time:
    (name, launches, microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE.type != "cuda":
        return 0, []
    fn(None)
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(None)
        _sync()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return len(kernels), [(name, len(us), round(sum(us), 1)) for name, us in ranked]


def _step_in_place(loop, prompt: list[int], max_new_tokens: int):
    """fn(kv_len): one full device-loop step, then the loop's state as it was before it. Replayed
    steps would otherwise walk past the end of the cache and of the step records."""
    loop.start(prompt, max_new_tokens)
    loop.first_step()
    s = loop.state
    live = (s.feats, s.meta, s.block, s.verify, s.pos, s.count, s.step)  # all the step writes but its record
    saved = [t.clone() for t in live]

    def step(kv_len: int) -> None:
        loop._step(kv_len)
        for t, v in zip(live, saved, strict=True):
            t.copy_(v)
    return step


LEVERS = ("pack", "target-pack", "split", "merge", "tails", "target-tails", "project", "accept")


# the levers that are a keyword of an engine's constructor: (engine, keyword)
_ENGINE_LEVERS = {"pack": (static_drafter.StaticDrafter, "packed"), "target-pack": (static_lm.StaticLM, "packed"),
                  "tails": (static_drafter.StaticDrafter, "tails"), "target-tails": (static_lm.StaticLM, "tails")}


def _turn_off(lever: str) -> None:
    """Patch one lever of the fast path out, for this process (the benchmark's own: the engines keep their
    defaults everywhere else)."""
    if lever in _ENGINE_LEVERS:
        engine, keyword = _ENGINE_LEVERS[lever]
        make = engine.__init__
        engine.__init__ = lambda self, *a, **k: make(self, *a, **k | {keyword: False})
    elif lever == "split":
        attend = span_attention.span_attention
        span_attention.span_attention = lambda *a, kv_len=None, **k: attend(*a, **k)
    elif lever == "merge":
        attend_split = span_attention.span_attention
        span_attention.span_attention = lambda *a, counters=None, **k: attend_split(*a, **k)
    elif lever == "project":  # both engines' q/k/v GEMMs apart from their RoPE and K/V write kernels
        linear_rope.takes = lambda layers, head_dim: False
    elif lever == "accept":
        accept = greedy_accept.accept_
        greedy_accept.accept_ = lambda pred, state, kernel=True: accept(pred, state, kernel=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sliding-layers", type=int, default=0,
                    help="draft layers with sliding-window attention (the SmolLM2 recipe's drafter: 1)")
    ap.add_argument("--sliding-window", type=int, default=16)
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the draft layers' MLP width (default: the target's; the SmolLM2 recipe's: 3072)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the caches")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=0, help="also list each part's N costliest kernels (an eager call)")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (no graphs, no kernel counts)")
    ap.add_argument("--without", action="append", default=[], choices=LEVERS,
                    help="time the step with this lever of the fast path off (repeatable)")
    args = ap.parse_args(argv)
    for lever in args.without:
        _turn_off(lever)
    global DEVICE
    DEVICE = dev = torch.device(args.device)
    B = args.block_size
    target = load_target(args.target, device=dev)
    shape = dict(num_sliding_layers=args.sliding_layers, intermediate_size=args.intermediate_size,
                 sliding_window=args.sliding_window if args.sliding_layers else None)
    drafter = new_drafter(drafter_config_for(target, num_layers=args.draft_layers, block_size=B, **shape), 0, dev)
    drafter = drafter.to(target.dtype).eval()
    lm = static_lm.for_model(target.model)
    layers = tuple(drafter.config.target_layer_ids)
    kv = static_lm.bucket(args.context + 2 * B)
    cache = lm.cache_for(1, kv)
    engine = static_drafter.for_drafter(drafter, target.model.get_input_embeddings(), target.lm_head)
    dcache = engine.cache_for(kv)
    one, block = torch.ones(1, 1, dtype=torch.long, device=dev), torch.ones(1, B, dtype=torch.long, device=dev)
    pos1 = torch.full((1, 1), args.context, device=dev)
    posB = (args.context + torch.arange(B, device=dev))[None]
    feats = torch.randn(1, B, len(layers) * target.hidden_size, device=dev, dtype=target.dtype)
    meta = torch.tensor([args.context - B, B, B], device=dev)
    loop = greedy_loop.for_pair(target, drafter)

    def parts(compiled: bool) -> dict:
        if compiled:
            compile_decode(target, drafter)
        dflash_step = _step_in_place(loop, list(range(1, args.context + 1)), 10 * B)
        # compiled steps attend over the whole cache (one shape), as eval's do
        kv_t, kv_d, kv_loop = ((cache.capacity, dcache.capacity, loop.caches[0].capacity) if compiled else (kv, kv, kv))
        fns = {
            "target_token": lambda _: lm.step_forward(one, pos1, cache, kv_t, logits="all").logits,
            "target_verify": lambda _: lm.step_forward(block, posB, cache, kv_t, layers=layers, logits="all").logits,
            "draft": lambda _: engine.step_forward(feats, block, meta, dcache, kv_d),
            "dflash_step": lambda _: dflash_step(kv_loop),
        }
        out = {}
        for name, fn in fns.items():
            count, ranked = _kernels(fn, args.top)
            out[name] = {"ms": _time(fn, args.reps), "kernels": count} | ({"top_kernels": ranked} if ranked else {})
            print(("compiled " if compiled else "eager ") + name, {k: out[name][k] for k in ("ms", "kernels")},
                  flush=True)
            for kname, n, us in ranked:
                print(f"    {us:9.1f} us  {n:4d}x  {kname}")
            if args.json:  # after every part: a later failure keeps what was measured
                _write(args.json, res | {("graphed_compiled" if compiled else "graphed"): out})
        out["step_over_token"] = round(out["dflash_step"]["ms"] / out["target_token"]["ms"], 3)
        return out

    res = {"target": args.target, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "date": date.today().isoformat(),
           "torch": torch.__version__, "draft_layers": args.draft_layers, "block_size": B, "context": args.context,
           "command": "python3 benchmarks/decode_parts.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "without": args.without}
    res["graphed"] = parts(False)
    if args.compile:
        with torch.no_grad():  # compiled steps reject inference_mode tensors
            res["graphed_compiled"] = parts(True)
    if args.json:
        _write(args.json, res)
    return 0


def _write(path: str, res: dict) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    raise SystemExit(main())
