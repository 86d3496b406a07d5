"""Acceptance-length evaluation: tau, acceptance by position, speedup and the lossless check.

For each prompt the target decodes alone (the baseline) and with the drafter, in the same
run on the same device, prefill excluded from both clocks. At T=0 the two outputs must be
identical token for token. Where they are not, the first divergence of each prompt is examined
with one more target forward on the shared prefix: the gap between the target's logits for the
two tokens. Block verification and one-token decoding run different kernels, so two logits
closer than rounding can swap places; `lossless` is

    exact       identical outputs
    ties-only   every divergence between two tokens whose logits differ by at most TIE_GAP for
                the target's dtype (numerics, not the drafter; rerun with --dtype float32)
    mismatch    some divergence at a larger gap: a real error, listed with its tokens and gap
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from dflash_train.config import MAX_BLOCK_SIZE, at_least, between, setting, validate
from dflash_train.decode.generate import now
from dflash_train.decode.speculative import DecodeResult, compile_decode, speculative_generate, target_generate
from dflash_train.decode.static_lm import KV_BUCKET, bucket
from dflash_train.errors import UsageError
from dflash_train.eval.lookup import LOOKUP_NGRAM, lookup_tau
from dflash_train.models.chat import stop_token_ids
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.fused import eager_chains
from dflash_train.models.target import Target

# the decode's commits replayed through the training path (training/replay.py: replay_commits), per prompt the
# tokens each verify step commits; eval/ cannot import it
Replay = Callable[[Target, DFlashDrafter, list[list[int]], list[list[int]], int], list[list[int]]]


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """[eval]: the prompts tau is measured on, and how they are decoded."""

    dataset: str = setting("humaneval", "prompts: humaneval, mtbench, sharegpt (held-out) or a .jsonl file")
    limit: int = setting(10, "prompts evaluated (train: after training, and before it with --eval-before; "
                             "0 = none)", at_least(0))
    max_new_tokens: int = setting(128, "tokens generated per prompt (with the prompt, at most the target's "
                                       "max_position_embeddings)", at_least(1))
    temperature: float = setting(0.0, "0 = greedy, checked lossless; > 0 = rejection sampling", at_least(0))
    block_size: int | None = setting(None, "verify block size (default: the drafter's)", between(2, MAX_BLOCK_SIZE))
    seed: int = setting(0, "seed of the sampling at temperature > 0", at_least(0))
    baseline: bool = setting(True, "also decode with the target alone: the speedup and the lossless check "
                                   "(--no-baseline: tau only, about half the time)")
    compile: bool = setting(False, "torch.compile the decode steps of the target and the drafter (both target-only "
                                   "and DFlash decoding; about 2x fewer kernels per step on CUDA; the warm-up "
                                   "compiles, so the clocks exclude it)")
    compile_drafter: bool = setting(False, "torch.compile the drafter's decode step only: the target's verify and "
                                           "the target-only baseline keep the path they decode on without "
                                           "--compile, so the speedup is against the same target")
    before: Literal["auto", "yes", "no"] = setting(
        "auto", "train: tau before training too: auto = only for a drafter that starts trained (--init-drafter); a "
                "fresh one, random or from the target's layers, accepts nothing (tau 1.000 on the H200 and CPU "
                "defaults), and its eval cost the CPU default 129 s")

    def __post_init__(self) -> None:
        validate(self)


# Largest logit gap between two diverging tokens still read as a tie, by the logits' dtype. The
# logits of these models are ~10-30 in magnitude, where a bfloat16 unit in the last place is
# 0.06-0.125 and a float16 one 0.008-0.016; two kernels summing in different orders differ by a
# few units. float32 differences come from upstream rounding (~1e-5 relative).
TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}
LOSSLESS = ("exact", "ties-only", "mismatch")


@dataclass
class Divergence:
    """The first token where a prompt's DFlash output leaves the target-only output."""

    prompt: int
    position: int
    """Index into the generated tokens."""
    target_token: int
    dflash_token: int
    gap: float | None
    """logit(target_token) - logit(dflash_token) in a fresh target forward on the shared prefix
    (None when one output is a prefix of the other: no token to compare)."""
    top2_margin: float | None
    """The target's top-1 minus top-2 logit there."""


@dataclass
class EvalReport:
    tau: float
    """Mean tokens committed per target verify step (bonus token included; at most B)."""
    lossless: str | None
    """T=0: exact | ties-only | mismatch (module docstring). None when not checked."""
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
    divergences: list[Divergence] = field(default_factory=list)
    tie_gap: float | None = None
    """The TIE_GAP that classified the divergences (the target's dtype)."""
    per_prompt_tau: list[float] = field(default_factory=list)
    per_prompt_steps: list[int] = field(default_factory=list)
    """Each prompt's tau and verify steps: tau over any subset is sum(tau * steps) / sum(steps)."""
    tau_by_category: dict[str, float] | None = None
    """tau over each category's prompts (by_category), where the eval set names them."""
    tau_replay: float | None = None
    """T=0: the decode's tau replayed through the training path on the same outputs (training/replay.py); equal to
    tau up to rounding when decoding computes what training does. None at T > 0 or another block size."""
    per_prompt_tau_replay: list[float] | None = None
    """Each prompt's tau_replay beside per_prompt_tau: which prompts the two paths part on."""
    tau_lookup: float | None = None
    """T=0: the tau prompt lookup (copying from the prompt and the output so far) gets on the same outputs
    (eval/lookup.py): the drafter any target has for free. None at T > 0."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Where the eval's wall time went: warm-up (untimed decodes: graph captures, kernel compiles), decode (the
    timed decodes, prefill and both decoders included), replay (the training path, T=0) and the rest."""

    def to_json(self, path: str | Path, flag: str = "--json") -> None:
        """Written in place, not atomically: `path` may be a device or a pipe, never renamed over."""
        try:
            Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot write the report ({e.strerror or e})") from None

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
        if self.tau_by_category:
            lines.append("tau by category:            "
                         + "  ".join(f"{c} {t:.2f}" for c, t in self.tau_by_category.items()))
        if self.lossless is not None:
            lines.append("lossless:                   " + self._lossless_text())
        if self.tau_replay is not None:
            lines.append(f"training path, same outputs: tau {self.tau_replay:.3f} (the decode's up to rounding when "
                         "serving computes what training does)")
        if self.tau_lookup is not None:
            lines.append(f"prompt lookup, same outputs: tau {self.tau_lookup:.3f} (copying {LOOKUP_NGRAM}-grams of the "
                         "prompt and output)")
        if self.phases_s:
            lines.append("eval wall time:             " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases_s.items()))
        return "\n".join(lines)

    def by_category(self, categories: list[str]) -> dict[str, float]:
        """tau over each category's prompts (steps-weighted, as `tau` is over all), in first-seen order."""
        if len(categories) != len(self.per_prompt_tau):
            raise ValueError(f"{len(categories)} categories for {len(self.per_prompt_tau)} prompts")
        committed: dict[str, float] = {}
        steps: dict[str, int] = {}
        for c, t, n in zip(categories, self.per_prompt_tau, self.per_prompt_steps, strict=True):
            committed[c] = committed.get(c, 0.0) + t * n
            steps[c] = steps.get(c, 0) + n
        return {c: committed[c] / steps[c] if steps[c] else 1.0 for c in committed}

    def _lossless_text(self) -> str:
        if self.lossless == "exact":
            return "exact (identical to target greedy output)"
        gaps = ", ".join(f"{d.prompt}@{d.position}: " + ("-" if d.gap is None else f"{d.gap:.3g}")
                         for d in self.divergences)
        if self.lossless == "ties-only":
            return (f"ties-only - outputs differ on prompts {self.mismatched_prompts}, each where two of the target's "
                    f"logits are within {self.tie_gap:g} (prompt@token: gap {gaps}); --dtype float32 checks exactly")
        return (f"MISMATCH - outputs differ from target greedy output on prompts {self.mismatched_prompts} "
                f"(prompt@token: logit gap {gaps}; ties are <= {self.tie_gap:g})")


def warm_prompts(prompts: list[list[int]], block_size: int, max_new_tokens: int,
                 size: int = KV_BUCKET) -> list[list[int]]:
    """The prompts a CUDA warm-up decodes in full: the longest first (it sizes the caches that every later
    decode reuses, with their graphs), then one of every other set of graph keys a prompt's decodes meet. A
    decode captures a graph per key-length bucket it reaches, from its first step's to its last's, so the set
    holds the buckets of the prompt's prefill, of both decoders' first and last steps at the token limit, and
    of the drafter's pass over its first L - B tokens (rows and keys; greedy_loop.first_step). Prompts with
    the same set meet the same graphs. A key first met on the clock costs the timed decode an eager run, a
    capture and, for a new shape of a decode kernel, a Triton compile: the prompt buckets alone left ~0.64 s
    of the SmolLM2 recipe's ~3 s of HumanEval DFlash decoding on the clock (benchmarks/eval_clock.py)."""
    B = block_size

    def keys(p: list[int]) -> tuple[int, ...]:
        L = len(p)
        rows = L - min(L, B)
        last = L + max_new_tokens
        return tuple(bucket(n, size) for n in (L, L + 1, L + B, rows, rows + 1, last, last - 1 + 2 * B))

    longest = max(prompts, key=len)
    shortest: dict[tuple[int, ...], list[int]] = {}
    for p in sorted(prompts, key=len):
        shortest.setdefault(keys(p), p)
    return [longest] + [p for k, p in sorted(shortest.items()) if k != keys(longest)]


def evaluate(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], cfg: EvalConfig,
             progress: bool = True, replay: Replay | None = None) -> EvalReport:
    """Decode every prompt (token ids, chat template applied) with and without the drafter.

    replay: (target, drafter, prompts, the decode's outputs, max_new_tokens) -> per prompt the tokens each verify
    step commits through the training path (training/replay.py: replay_commits), the report's tau_replay at T=0
    and the drafter's block size.

    The drafter's modules run their elementwise chains eagerly here (fused.eager_chains): the decode engines
    call a module's norm once a step, and compiling the chains for decoding's grad mode took seconds a chain
    on a fresh machine (docs/evaluation.md)."""
    with eager_chains():
        return _evaluate(target, drafter, prompts, cfg, progress, replay)


def _evaluate(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], cfg: EvalConfig,
              progress: bool, replay: Replay | None) -> EvalReport:
    B = cfg.block_size or drafter.block_size
    stops = stop_token_ids(target)
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    # Warm-up outside the clocks: first-call allocations, kernel selection and, on CUDA, the
    # graph captures of the key-length buckets the prompts reach (warm_prompts). On CPU (no
    # graphs) a short run does: a full one would cost a whole prompt's decode.
    cuda = target.device.type == "cuda"
    clock = _Clock(target.device)
    new = cfg.max_new_tokens if cuda else 2 * B
    warm = warm_prompts(prompts, B, new) if cuda else [prompts[0][:32]]
    if (cfg.compile or cfg.compile_drafter) and not compile_decode(target, drafter, target_steps=cfg.compile):
        raise UsageError(f"{'--compile' if cfg.compile else '--compile-drafter'}: {target.config.model_type} "
                         "targets decode through HF's forward, which is not compiled")
    for prompt in warm:
        speculative_generate(target, drafter, prompt, new, cfg.temperature, B, [], gen)
        if cfg.baseline:
            target_generate(target, prompt, new, cfg.temperature, [], gen)
    clock.lap("warm-up")
    spec_runs: list[DecodeResult] = []
    base_runs: list[DecodeResult] = []
    for prompt in tqdm(prompts, desc="eval", unit="prompt", disable=not progress):
        spec_runs.append(speculative_generate(target, drafter, prompt, cfg.max_new_tokens, cfg.temperature, B, stops,
                                              gen))
        if cfg.baseline:
            base_runs.append(target_generate(target, prompt, cfg.max_new_tokens, cfg.temperature, stops, gen))
    clock.lap("decode")
    report = _report(spec_runs, base_runs, B, cfg)
    if report.mismatched_prompts:
        report.divergences = [divergence(target, prompts[i], i, spec_runs[i].tokens, base_runs[i].tokens)
                              for i in report.mismatched_prompts]
        report.tie_gap = TIE_GAP.get(target.dtype, TIE_GAP[torch.float32])
        report.lossless = lossless_status(report.divergences, report.tie_gap)
    outputs = [r.tokens for r in spec_runs]
    if cfg.temperature == 0:
        report.tau_lookup = lookup_tau(prompts, outputs, B)
    clock.lap("checks")
    if cfg.temperature == 0 and replay is not None and B == drafter.block_size:
        commits = replay(target, drafter, prompts, outputs, cfg.max_new_tokens)
        report.tau_replay = _mean([c for row in commits for c in row])
        report.per_prompt_tau_replay = [_mean(row) for row in commits]
        clock.lap("replay")
    report.phases_s = clock.laps
    return report


class _Clock:
    """Wall-time laps of the eval (each a host sync on CUDA: between phases, never inside a decode)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.laps = device, {}
        self.t = now(device)

    def lap(self, name: str) -> None:
        t = now(self.device)
        self.laps[name] = round(t - self.t, 3)
        self.t = t


@torch.inference_mode()
def divergence(target: Target, prompt: list[int], index: int, dflash: list[int], base: list[int]) -> Divergence:
    """Where two outputs first differ, and the target's logit gap between the two tokens there."""
    pos = next((j for j, (a, b) in enumerate(zip(dflash, base, strict=False)) if a != b), min(len(dflash), len(base)))
    if pos >= min(len(dflash), len(base)):  # one output is a prefix of the other: no shared-prefix tie
        return Divergence(index, pos, base[pos] if pos < len(base) else -1,
                          dflash[pos] if pos < len(dflash) else -1, None, None)
    ids = torch.tensor([prompt + base[:pos]], device=target.device)
    logits = target.model(ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return Divergence(index, pos, base[pos], dflash[pos], float(logits[base[pos]] - logits[dflash[pos]]),
                      float(top[0] - top[1]))


def lossless_status(divergences: list[Divergence], tie_gap: float) -> str:
    if not divergences:
        return "exact"
    return "ties-only" if all(d.gap is not None and abs(d.gap) <= tie_gap for d in divergences) else "mismatch"


def _mean(commits: list[int]) -> float:
    """tau of verify steps that committed these many tokens each (1.0 for none: a decode commits at least one)."""
    return sum(commits) / len(commits) if commits else 1.0


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
        hits = sum(1 for a, s in zip(accepted, slots, strict=True) if s >= k and a >= k)
        per_pos.append(hits / offered if offered else 0.0)
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
            mismatched = [i for i, (s, b) in enumerate(zip(spec, base, strict=True)) if s.tokens != b.tokens]
            lossless = "exact" if not mismatched else "mismatch"  # evaluate() tells ties apart
    return EvalReport(
        tau=_mean(committed),
        lossless=lossless, speedup=speedup, per_position_acceptance=per_pos, histogram=histogram,
        steps=steps, generated_tokens=sum(len(r.tokens) for r in spec), dflash_tokens_per_s=spec_tps,
        target_tokens_per_s=target_tps, block_size=B, temperature=cfg.temperature, num_prompts=len(spec),
        mismatched_prompts=mismatched,
        per_prompt_tau=[_mean(r.committed) for r in spec],
        per_prompt_steps=[len(r.committed) for r in spec],
    )
