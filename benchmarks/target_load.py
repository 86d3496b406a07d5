"""Loading the target cold (empty download cache: the GGUF is converted and its copy written) and warm
(from that copy), each in a fresh process.

    python3 benchmarks/target_load.py [--target smollm2-135m] [--device cpu] [--runs 3] [--json OUT.json]

The clock runs around load_target alone, after the imports and (on CUDA) the device's initialisation,
timed apart: the train job's "load target" phase. The cache is a private temporary directory
(DFLASH_TRAIN_CACHE), emptied before each cold load; the user's own cache is never read. Prints each
run and the minimum of each kind (a shared host's other jobs only ever add time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3, help="cold loads, and as many warm ones")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one load, its times on stdout
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(load_once(args.target, args.device)))
        return 0
    out = {"target": args.target, "device": args.device, "date": date.today().isoformat(),
           "command": "python3 benchmarks/target_load.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    with tempfile.TemporaryDirectory(prefix="target-load-") as cache:
        for kind in ("cold", "warm"):
            runs = [_child(args, cache, empty=kind == "cold") for _ in range(args.runs)]
            out[kind] = {"seconds": [r["seconds"] for r in runs], "min_s": min(r["seconds"] for r in runs)}
            print(f"{kind}: {', '.join(f'{r:.2f}' for r in out[kind]['seconds'])} s (min {out[kind]['min_s']:.2f})")
        out |= {k: runs[-1][k] for k in ("device_name", "device_init_s", "transformers")}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def load_once(spec: str, device: str) -> dict:
    import torch
    import transformers

    from dflash_train.models.loading import load_target

    t0 = time.perf_counter()
    torch.zeros(1, device=device)  # the device's initialisation, apart from the load
    device_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = load_target(spec, device=device)
    if target.device.type == "cuda":
        torch.cuda.synchronize()  # the host-to-device copies are asynchronous
    name = torch.cuda.get_device_name(0) if target.device.type == "cuda" else "cpu"
    return {"seconds": round(time.perf_counter() - t0, 3), "device_init_s": round(device_init, 3),
            "device_name": name, "transformers": transformers.__version__}


def _child(args, cache: str, empty: bool) -> dict:
    if empty:
        shutil.rmtree(cache)
        os.mkdir(cache)
    cmd = [sys.executable, __file__, "--one", "--target", args.target, "--device", args.device]
    proc = subprocess.run(cmd, env=os.environ | {"DFLASH_TRAIN_CACHE": cache}, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
