"""The sections of the tree that no lower component owns: what the app layer reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_train.config import MAX_BLOCK_SIZE, MAX_MLP_RATIO, at_least, between, setting, validate
from dflash_train.errors import UsageError
from dflash_train.models.experts import ExpertsChoice


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """[run]: where the run lives, its target and its seed."""

    run_dir: str = setting("runs/default", "run directory: data cache, checkpoints, metrics, exported drafter")
    target: str = setting("smollm2-135m", "smollm2-135m (embedded), random:<preset>, a .gguf file, an HF directory "
                                          "or a hub id")
    device: str = setting("auto", "cpu, cuda, cuda:N or auto")
    dtype: str | None = setting(None, "target compute dtype (default float32 on CPU, bfloat16 on CUDA)")
    target_seed: int = setting(0, "weights seed of random:<preset> targets", at_least(0))
    seed: int = setting(0, "seed of the drafter init, data order, anchors and sampling", at_least(0))

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """[data]: the conversations, how they become training sequences, and how those are packed."""

    data: str = setting("sharegpt", "conversations: sharegpt (embedded) or a .json/.jsonl file")
    split: str | None = setting(None, "train, held-out or all (default: train for the embedded sharegpt, whose "
                                      "held-out 2% eval uses; all for a file of your own)")
    num_conversations: int = setting(160, "conversations to use from --data (0 = all)", at_least(0))
    data_topic: Literal["code", "any"] = setting("code", "keep only conversations whose first prompt is about: "
                                                         "code | any (the embedded default evaluates on HumanEval, "
                                                         "so it trains on ShareGPT's coding slice)")
    on_bad: Literal["error", "skip"] = setting("skip", "bad records: skip (counted and reported) or error "
                                                       "(stop at file:line)")
    regenerate: bool = setting(True, "let the target rewrite the assistant turns ([regeneration]; cached in "
                                     "RUN_DIR)")
    labels: Literal["data", "target"] = setting("data", "block labels: data (the text's own tokens) or target (the "
                                                        "target's greedy token given the true prefix: computed in "
                                                        "training's target forward, or the data's labels.npy from "
                                                        "relabel)")
    max_length: int = setting(512, "tokens per training sequence (longer ones are truncated)", at_least(2))
    token_budget: int | None = setting(None, "context tokens packed into one step (default: --max-length, one "
                                             "sequence)", at_least(1))

    def __post_init__(self) -> None:
        validate(self)
        if self.split not in (None, "train", "held-out", "all"):
            raise UsageError(f"--split must be train, held-out or all, got {self.split!r}")
        if self.token_budget is None:  # resolved here: every reader sees a number
            self.token_budget = self.max_length
        elif self.token_budget < self.max_length:
            raise UsageError(f"--token-budget {self.token_budget} must hold one sequence "
                             f"(--max-length {self.max_length})")


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    """[drafter]: the shape of a fresh drafter, or the drafter to start from."""

    num_layers: int = setting(1, "draft layers (at most the target's)", at_least(1))
    block_size: int = setting(4, f"block size B (2..{MAX_BLOCK_SIZE})", between(2, MAX_BLOCK_SIZE))
    num_features: int | None = setting(None, "target feature layers (default 5, fewer for shallow targets; at most "
                                             "the target's layers 1..N-3, over which they are spread)", at_least(1))
    target_layer_ids: list[int] | None = setting(None, "explicit feature layers, e.g. 1,9,17 (instead of "
                                                       "--num-features)")
    mask_token_id: int | None = setting(None, "mask token (default: the first spare embedding row, else an unused "
                                              "special token)", at_least(0))
    intermediate_size: int | None = setting(None, f"the draft layers' MLP width (default: the target's; at most "
                                                  f"{MAX_MLP_RATIO} x its hidden size); wider adds capacity and "
                                                  "training FLOPs, while at batch-1 decode its small matmuls are "
                                                  "latency-bound", at_least(1))
    num_key_value_heads: int | None = setting(None, "the draft layers' key/value heads (default: the target's; a "
                                                    "divisor of its attention heads, and with --init-from-target a "
                                                    "multiple of its key/value heads): more let the query heads of a "
                                                    "layer read keys of their own, where a target with one KV head "
                                                    "(Gemma 3 270M) gives every head the same", at_least(1))
    sliding_layers: int = setting(1, "draft layers (the first ones) with sliding-window attention", at_least(0))
    sliding_window: int | None = setting(16, "window of the sliding-window draft layers", at_least(1))
    init_drafter: str | None = setting(None, "start from this drafter directory instead of a fresh init")
    init_from_target: bool = setting(True, "initialise the draft layers from the target's last layers and final "
                                           "norm (else random); needs matching shapes")

    def __post_init__(self) -> None:
        validate(self)
        if self.sliding_layers > self.num_layers:
            raise UsageError(f"--sliding-layers must be in 0..--num-layers ({self.num_layers}), "
                             f"got {self.sliding_layers}")
        if self.sliding_layers and self.sliding_window is None:
            raise UsageError("--sliding-window must be >= 1 when --sliding-layers > 0")
        if self.num_features is not None and self.target_layer_ids is not None:
            raise UsageError("--num-features and --target-layer-ids: give one (the ids fix the number of features)")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """[pipeline]: where the target and the drafter run, and how features travel between them."""

    target_devices: str | None = setting(None, "devices of the target workers, comma-separated (e.g. cuda:0); "
                                                "with --drafter-devices: one process per device")
    drafter_devices: str | None = setting(None, "devices of the drafter workers, comma-separated (e.g. "
                                                 "cuda:1,cuda:2); several = data parallel; the same list as "
                                                 "--target-devices = a target and a drafter on every device "
                                                 "(whole pipelines, data parallel)")
    target_tp: int = setting(1, "devices per target replica: --target-devices in groups of this many, each group "
                                "holding one target split by tensor parallelism (a target too big for one device)",
                             at_least(1))
    overlap: bool | None = setting(None, "a device holding both roles: run the target on its own thread and CUDA "
                                         "stream so its forwards fill the drafter's gaps (default: on for CUDA, off "
                                         "for CPU)")
    queue_depth: int = setting(4, "depth of the batch queue and of the feature (hs) queue", at_least(1))
    peer_timeout: float = setting(600.0, "seconds without progress before a worker is reported stuck")
    dist_port: int = setting(0, "TCP port of the torch.distributed rendezvous on this host (0 = a free one)")
    compile_target: bool = setting(False, "torch.compile the target's decoder layers for the feature forwards "
                                          "(one graph for all layers, compiled once per run; a MoE target's "
                                          "forward ran 2x faster so)")
    target_experts: ExpertsChoice = setting("auto", "the kernel of a mixture-of-experts target's experts: auto = "
                                                    "dflash_grouped (transformers' grouped_mm GEMMs with a "
                                                    "one-pass top-k combine kernel) for bf16 on CUDA, else eager "
                                                    "(transformers' loop over the experts); batched_mm copies "
                                                    "weights per token (tiny shapes only); dense targets ignore it")
    cache_features: bool | None = setting(None, "compute each sequence's target features once and keep them in the "
                                                "target's device memory (tokens x features x hidden x 2 bytes on a "
                                                "GPU), so the target runs only in the first epoch (default: on for "
                                                "CPU)")

    def __post_init__(self) -> None:
        validate(self)
        if not self.peer_timeout > 0:
            raise UsageError(f"--peer-timeout must be > 0 seconds, got {self.peer_timeout}")
        if not 0 <= self.dist_port < 65536:
            raise UsageError(f"--dist-port must be a TCP port (0 = any free one), got {self.dist_port}")
        if self.target_tp > 1 and self.target_devices is None:
            raise UsageError(f"--target-tp {self.target_tp} needs --target-devices and --drafter-devices "
                             "(the target's replicas run in processes of their own)")
        if self.target_tp > 1 and self.cache_features:
            raise UsageError("--cache-features: a target split by --target-tp recomputes its features (its ranks "
                             "must run every forward together)")
        if (self.target_devices is None) != (self.drafter_devices is None):
            raise UsageError("--target-devices and --drafter-devices go together (or leave both out and use --device)")
