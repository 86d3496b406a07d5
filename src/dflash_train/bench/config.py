"""The bench's settings (the `bench` command's flags), its variants and its several-GPU splits."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.config import RELEASED, AttentionBackend, flag, same_as, setting, validate
from dflash_train.errors import UsageError
from dflash_train.models.experts import CHOICES as EXPERTS
from dflash_train.objective.objective import ObjectiveConfig
from dflash_train.settings.sections import DataConfig, DrafterConfig, PipelineConfig, RunConfig
from dflash_train.settings.tree import TrainConfig
from dflash_train.training.config import TrainerConfig

VARIANTS = ("sequential", "overlap", "overlap+wall", "overlap+cuda", "target-only", "drafter-only")


def _experts_list(text: str) -> str | None:
    bad = [c for c in _items(text) if c not in EXPERTS]
    if bad or not _items(text):
        return f"must be comma-separated from {', '.join(EXPERTS)}, got {text!r}"
    return None


def _items(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """The bench's flags: train's settings (config.py) with the released drafter's shape as overrides."""

    target: str = same_as(RunConfig, "target", default="random:qwen3-8b")  # real shapes, random weights
    device: str = same_as(RunConfig, "device")
    num_layers: int = same_as(DrafterConfig, "num_layers", default=RELEASED["num_layers"])
    block_size: int = same_as(DrafterConfig, "block_size", default=RELEASED["block_size"])
    num_anchors: int = same_as(ObjectiveConfig, "num_anchors", default=RELEASED["num_anchors"])
    seq_len: int = setting(3072, "tokens per sequence (= --max-length of train)")
    token_budget: int | None = same_as(DataConfig, "token_budget")  # None: one sequence of --seq-len a pack
    intermediate_size: int | None = same_as(DrafterConfig, "intermediate_size")
    num_key_value_heads: int | None = same_as(DrafterConfig, "num_key_value_heads")
    sliding_layers: int = same_as(DrafterConfig, "sliding_layers", default=0)
    sliding_window: int | None = same_as(DrafterConfig, "sliding_window")
    steps: int = setting(10, "measured optimizer steps per variant")
    variants: str = setting(",".join(VARIANTS), f"comma-separated, from: {', '.join(VARIANTS)}")
    attention: AttentionBackend = same_as(ObjectiveConfig, "attention")
    loss_chunk_rows: int = same_as(ObjectiveConfig, "loss_chunk_rows")
    seed: int = same_as(RunConfig, "seed")
    splits: str = setting("", "several GPUs: T+D (T target, D drafter GPUs) or xN (N GPUs with both roles), "
                      "comma-separated, e.g. 1+1,x2 (bench/multi.py)")
    compile_target: bool = same_as(PipelineConfig, "compile_target")
    compile_drafter: bool = same_as(TrainerConfig, "compile_drafter")
    compile_stack: bool = same_as(TrainerConfig, "compile_stack")
    compile_masks: bool = same_as(TrainerConfig, "compile_masks")
    target_experts: str = setting("auto", "train's --target-experts (the kernel of a mixture-of-experts target's "
                                  "experts); comma-separated runs every variant under each, side by side, e.g. "
                                  "eager,grouped_mm", _experts_list)
    cold_start: bool = setting(False, "every variant's process starts with empty compile caches (inductor, Triton)")

    def __post_init__(self) -> None:
        validate(self)
        for name in ("seq_len", "steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.token_budget is not None and self.token_budget < self.seq_len:
            raise UsageError(f"--token-budget {self.token_budget} must hold one sequence of --seq-len {self.seq_len}")
        parse_splits(self.splits)  # a bad split fails here, before any model is loaded
        bad = [v for v in self.variant_list if v not in VARIANTS]
        if bad:
            raise UsageError(f"--variants: unknown {bad} (choose from {', '.join(VARIANTS)})")
        if self.splits and len(self.experts_list) > 1:
            raise UsageError(f"--target-experts {self.target_experts}: --splits runs one experts kernel (give one)")

    @property
    def pack_tokens(self) -> int:
        """Tokens per pack: --token-budget, or one sequence of --seq-len."""
        return self.token_budget or self.seq_len

    @property
    def seqs_per_pack(self) -> int:
        return self.pack_tokens // self.seq_len

    @property
    def variant_list(self) -> list[str]:
        return _items(self.variants)

    @property
    def experts_list(self) -> list[str]:
        return _items(self.target_experts)

    def runs(self) -> list[tuple[str, str, str]]:
        """(name, variant, experts) of each one-device run: the variant's name alone for one experts
        kernel, else `variant@experts` for every variant under every kernel."""
        one = len(self.experts_list) == 1
        return [(v if one else f"{v}@{e}", v, e) for e in self.experts_list for v in self.variant_list]


def train_config(cfg: BenchConfig, run_dir: Path, variant: str, total: int, experts: str | None = None,
                 **extra) -> TrainConfig:
    """The `train` settings of one variant's run: the bench's shapes, no checkpoints, no eval."""
    base = dict(run_dir=str(run_dir), target=cfg.target, seed=cfg.seed, num_layers=cfg.num_layers,
                block_size=cfg.block_size, num_anchors=cfg.num_anchors, token_budget=cfg.pack_tokens,
                max_length=cfg.seq_len, intermediate_size=cfg.intermediate_size,
                num_key_value_heads=cfg.num_key_value_heads, sliding_layers=cfg.sliding_layers,
                sliding_window=cfg.sliding_window, compile_drafter=cfg.compile_drafter, compile_stack=cfg.compile_stack,
                compile_masks=cfg.compile_masks, attention=cfg.attention, loss_chunk_rows=cfg.loss_chunk_rows,
                max_steps=total, log_every=cfg.steps, checkpoint_every=0, cache_features=variant == "drafter-only",
                overlap=variant.startswith("overlap"), profile_interval=10.0 if "+" in variant else None,
                profile_cuda_events=variant.endswith("+cuda"), lr=6e-4, eval_limit=0,
                compile_target=cfg.compile_target, target_experts=experts or cfg.experts_list[0])
    return TrainConfig.of(**(base | extra))


_SPLIT = re.compile(r"^(\d+)\+(\d+)$|^x(\d+)$")


@dataclass(frozen=True)
class Split:
    name: str
    targets: int
    drafters: int
    colocated: bool  # every GPU holds both roles

    @classmethod
    def parse(cls, text: str) -> Split:
        m = _SPLIT.match(text)
        if not m or (m.group(3) and int(m.group(3)) < 1) or (m.group(1) and min(int(m.group(1)), int(m.group(2))) < 1):
            raise UsageError(f"--splits: {text!r} is not T+D (T target GPUs, D drafter GPUs, both >= 1) "
                             "or xN (N GPUs each holding a target and a drafter)")
        if m.group(3):
            n = int(m.group(3))
            return cls(text, n, n, True)
        return cls(text, int(m.group(1)), int(m.group(2)), False)

    @property
    def gpus(self) -> int:
        return self.targets if self.colocated else self.targets + self.drafters

    def devices(self, kind: str = "cuda") -> tuple[str, str]:
        """--target-devices, --drafter-devices (on CPU: gloo processes sharing the host's cores)."""
        names = [f"cuda:{i}" for i in range(self.gpus)] if kind == "cuda" else ["cpu"] * self.gpus
        if self.colocated:
            return ",".join(names), ",".join(names)
        if kind != "cuda" and self.targets == self.drafters:
            raise UsageError(f"--splits {self.name}: on CPU equal lists mean colocated workers; use x{self.targets}")
        return ",".join(names[: self.targets]), ",".join(names[self.targets:])


def parse_splits(text: str) -> list[Split]:
    return [Split.parse(t.strip()) for t in text.split(",") if t.strip()]


def check_gpus(splits: list[Split], device: torch.device) -> None:
    have = torch.cuda.device_count() if device.type == "cuda" else None
    for s in splits:
        if have is not None and s.gpus > have:
            raise UsageError(f"--splits {s.name}: needs {s.gpus} GPUs, this machine has {have}")
        s.devices(device.type)  # the CPU ambiguity, before anything runs
