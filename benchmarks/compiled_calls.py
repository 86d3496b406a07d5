"""What a compiled call costs the host: a training step of a tiny drafter (so the kernels take next to nothing) with its
layers eager, compiled one call a layer (--compile-drafter), and compiled as one graph (--compile-stack).

    python3 benchmarks/compiled_calls.py                         # CPU: aot_eager (dynamo and AOTAutograd, eager ops)
    python3 benchmarks/compiled_calls.py --device cuda --backend inductor --json OUT.json

Each compiled call runs its guards and AOTAutograd's wrapper before its first kernel, forward and backward: 2 x 12
calls a step for the recipe's 12 layers, 2 for the stack. With the kernels tiny, the step's time is the host's, so
(layers - stack) / 22 is about one call's cost. Prints one line a mode and the per-call estimate; --json writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from dflash_train.models.config import DFlashConfig
from dflash_train.models.drafter import DFlashDrafter

MODES = ("eager", "layers", "stack")


def drafter_of(layers: int, device: torch.device) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=8, mask_token_id=0,
                       target_layer_ids=[0, 1], num_target_layers=max(layers, 3))
    drafter = DFlashDrafter(cfg).to(device)
    drafter.init_weights(0)
    return drafter


def time_mode(mode: str, layers: int, backend: str, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds of the first step (compiles) and the best mean step over 7 rounds of `reps` steps."""
    torch._dynamo.reset()
    drafter = drafter_of(layers, device)
    q, c = 16, 32
    gen = torch.Generator(device).manual_seed(0)
    emb = torch.randn(1, q, 64, device=device, generator=gen)
    feats = torch.randn(1, c, 128, device=device, generator=gen)
    pos = torch.arange(c + q, device=device)[None]
    masks = {"full_attention": torch.ones(1, 1, q, c + q, dtype=torch.bool, device=device)}

    def step():
        drafter.zero_grad(set_to_none=True)
        drafter(emb, feats, pos, masks=masks).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()  # each round ends on the device: the host's time is the step's

    compiled = drafter.compiled_layers(backend=backend, stack=mode == "stack") if mode != "eager" \
        else contextlib.nullcontext()
    with compiled:
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(3):
            step()
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            best = min(best, (time.perf_counter() - t0) / reps)
    return {"first_step_s": first, "step_ms": best * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend (the GPU's: inductor)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--reps", type=int, default=20, help="steps a round (7 rounds, the best kept)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    results = {m: time_mode(m, args.layers, args.backend, device, args.reps) for m in args.modes.split(",")}
    for m, r in results.items():
        print(f"{m:>6}: step {r['step_ms']:.2f} ms, first step {r['first_step_s']:.1f} s")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "backend": args.backend,
           "layers": args.layers, "torch": torch.__version__, "modes": results}
    if {"layers", "stack"} <= results.keys():
        calls = 2 * (args.layers - 1)  # compiled calls a step the stack saves, forward and backward
        out["ms_per_call"] = (results["layers"]["step_ms"] - results["stack"]["step_ms"]) / calls
        print(f"one compiled call ~{out['ms_per_call'] * 1e3:.0f} us of host time ({calls} fewer calls a step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
