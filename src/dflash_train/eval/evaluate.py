"""Acceptance-length evaluation: tau, acceptance by position, speedup and the lossless check.

For each prompt the target decodes alone (the baseline) and with the drafter, in the same
run on the same device, prefill excluded from both clocks. At T=0 the two outputs must be
identical token for token; a mismatch makes `lossless` false and is listed, never hidden.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_train.errors import UsageError
from dflash_train.eval.speculative import DecodeResult, speculative_generate, target_generate
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.targets import Target


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    max_new_tokens: int = 256
    """Tokens generated per prompt (--max-new-tokens)."""
    temperature: float = 0.0
    """0 = greedy (checked lossless); > 0 = rejection sampling (--temperature)."""
    block_size: int | None = None
    """Verify block size; default the drafter's own (--block-size)."""
    seed: int = 0
    baseline: bool = True
    """Also decode with the target alone: needed for speedup and the lossless check."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block-size must be >= 2, got {self.block_size}")


@dataclass
class EvalReport:
    tau: float
    """Mean tokens committed per target verify step (bonus token included; at most B)."""
    lossless: bool | None
    """T=0: every output equals the target's own greedy output. None when not checked."""
    speedup: float | None
    """Target-only decode time per token / DFlash decode time per token (prefill excluded)."""
    per_position_acceptance: list[float]
    """k-th entry: fraction of steps whose draft slot k+1 was accepted (unconditional)."""
    histogram: list[int]
    """i-th entry: number of steps that accepted exactly i draft tokens."""
    steps: int
    generated_tokens: int
    dflash_tokens_per_s: float
    target_tokens_per_s: float | None
    block_size: int
    temperature: float
    num_prompts: int
    mismatched_prompts: list[int] = field(default_factory=list)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    def summary(self) -> str:
        acc = " ".join(f"{a:.2f}" for a in self.per_position_acceptance)
        lines = [
            f"tau (mean accepted length): {self.tau:.3f}   over {self.steps} verify steps, {self.num_prompts} prompts, "
            f"B={self.block_size}, T={self.temperature}",
            f"acceptance by position:     {acc}",
            f"accepted-drafts histogram:  {self.histogram}",
            f"decode tokens/s:            dflash {self.dflash_tokens_per_s:.1f}"
            + (f"   target-only {self.target_tokens_per_s:.1f}   speedup {self.speedup:.2f}x" if self.speedup else ""),
        ]
        if self.lossless is not None:
            lines.append("lossless:                   " + ("yes (identical to target greedy output)" if self.lossless
                         else f"NO - outputs differ from target greedy output on prompts {self.mismatched_prompts}"))
        return "\n".join(lines)


def evaluate(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], cfg: EvalConfig,
             progress: bool = True) -> EvalReport:
    """Decode every prompt (token ids, chat template applied) with and without the drafter."""
    B = cfg.block_size or drafter.block_size
    stops = target.stop_token_ids()
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    # Warm-up outside the clocks: first-call allocations, kernel selection and, on CUDA, the
    # graph captures of every key-length bucket (the longest prompt at full length reaches them all).
    # On CPU (no graphs) a short run does: a full one would cost a whole prompt's decode.
    warm, new = (max(prompts, key=len), cfg.max_new_tokens) if target.device.type == "cuda" else (prompts[0][:32], 2 * B)
    speculative_generate(target, drafter, warm, new, cfg.temperature, B, [], gen)
    if cfg.baseline:
        target_generate(target, warm, new, cfg.temperature, [], gen)

    spec_runs: list[DecodeResult] = []
    base_runs: list[DecodeResult] = []
    for prompt in tqdm(prompts, desc="eval", unit="prompt", disable=not progress):
        spec_runs.append(speculative_generate(target, drafter, prompt, cfg.max_new_tokens, cfg.temperature, B, stops, gen))
        if cfg.baseline:
            base_runs.append(target_generate(target, prompt, cfg.max_new_tokens, cfg.temperature, stops, gen))
    return _report(spec_runs, base_runs, B, cfg)


def _report(spec: list[DecodeResult], base: list[DecodeResult], B: int, cfg: EvalConfig) -> EvalReport:
    committed = [c for r in spec for c in r.committed]
    accepted = [a for r in spec for a in r.accepted]
    slots = [s for r in spec for s in r.slots]
    steps = len(committed)
    histogram = [0] * B
    for a in accepted:
        histogram[a] += 1
    per_pos = []
    for k in range(1, B):
        offered = sum(1 for s in slots if s >= k)
        per_pos.append(sum(1 for a, s in zip(accepted, slots) if s >= k and a >= k) / offered if offered else 0.0)
    # The first token comes from prefill; decode time covers the rest.
    spec_tokens = sum(len(r.tokens) - 1 for r in spec)
    spec_time = sum(r.decode_s for r in spec)
    spec_tps = spec_tokens / spec_time if spec_time > 0 else 0.0
    target_tps = speedup = lossless = None
    mismatched: list[int] = []
    if base:
        base_tokens = sum(len(r.tokens) - 1 for r in base)
        base_time = sum(r.decode_s for r in base)
        target_tps = base_tokens / base_time if base_time > 0 else 0.0
        speedup = spec_tps / target_tps if target_tps else None
        if cfg.temperature == 0:
            mismatched = [i for i, (s, b) in enumerate(zip(spec, base)) if s.tokens != b.tokens]
            lossless = not mismatched
    return EvalReport(
        tau=sum(committed) / steps if steps else 1.0,
        lossless=lossless, speedup=speedup, per_position_acceptance=per_pos, histogram=histogram,
        steps=steps, generated_tokens=sum(len(r.tokens) for r in spec), dflash_tokens_per_s=spec_tps,
        target_tokens_per_s=target_tps, block_size=B, temperature=cfg.temperature, num_prompts=len(spec),
        mismatched_prompts=mismatched,
    )
