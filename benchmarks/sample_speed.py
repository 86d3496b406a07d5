"""One sampled token for a batch of rows: torch.multinomial over the tempered softmax against the Gumbel-max kernel.

    python3 benchmarks/sample_speed.py              # one GPU, seconds: 2,048 rows, SmolLM2's, Gemma 3's vocabularies
    python3 benchmarks/sample_speed.py --rows 1,128,2048 --vocab 49152 --blocks 1024,2048,4096
    TRITON_INTERPRET=1 python3 benchmarks/sample_speed.py --device cpu --rows 128 --vocab 1000   # the plumbing

Variants on the same bf16 logits [rows, vocab] (decode/sampling.py pick at T > 0):
- `multinomial`: the cast, the division by T, the softmax and torch.multinomial (sampling.multinomial);
- `kernel B`: decode/sample_kernel.py with B columns an iteration (the library's default is marked).
Each prints microseconds a call (CUDA events, mean of 50 after 5 warm-ups) and the rate of the logits'
bytes (read once is all the kernel needs). Below sample_kernel.MIN_ROWS rows pick keeps multinomial; the
kernel is timed there anyway, to show why. On a CPU the times mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Run from a checkout without installing: the working tree's sources come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling moe_combine.py

from moe_combine import kernel_args, mean_us  # noqa: E402

from dflash_train.decode import sample_kernel  # noqa: E402
from dflash_train.decode.sampling import multinomial  # noqa: E402


def time_samplers(rows: int, vocab: int, args: argparse.Namespace, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(args.seed)
    logits = (3 * torch.randn(rows, vocab, device=device, generator=gen)).to(torch.bfloat16)
    seed = sample_kernel.seed_for(device, gen)
    variants = {"multinomial": lambda: multinomial(logits, args.temperature, gen)}
    for block in (int(b) for b in args.blocks.split(",")):
        mark = "*" if block == sample_kernel.BLOCK else ""
        variants[f"kernel {block}{mark}"] = lambda b=block: sample_kernel.sample(logits, args.temperature, seed, b)
    nbytes = logits.numel() * logits.element_size()
    for name, fn in variants.items():
        us = mean_us(fn, device, n=50 if device.type == "cuda" else 2)
        print(f"rows={rows} vocab={vocab} {name:14s} {us:9.1f} us  {nbytes / us / 1e6:6.2f} TB/s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2048", help="comma-separated row counts")
    p.add_argument("--vocab", default="49152,262144", help="comma-separated vocabulary sizes")
    p.add_argument("--blocks", default=str(sample_kernel.BLOCK), help="comma-separated column blocks")
    p.add_argument("--temperature", type=float, default=0.7)
    args, device = kernel_args(p, sample_kernel.triton is not None)
    if device is None:
        return 2
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            time_samplers(rows, vocab, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
