"""Where the target goes, checked before anything loads: the memory plan of each target GPU, and what
a target split by --target-tp asks of the job.

No process holds a split target whole: the job reads only its head (the tokenizer, the drafter's start),
the first replica computes the held-out packs, regeneration goes through a server, and the evaluation is
left to `dflash-train eval` where the target fits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_train.devices import available_memory
from dflash_train.errors import UsageError, say
from dflash_train.models.memory_plan import plan_memory
from dflash_train.models.shapes import head_dim
from dflash_train.models.sharded_loading import target_config
from dflash_train.models.tp_plan import check_tp_size, tensor_plan
from dflash_train.settings.tree import TrainConfig

DEFAULT_FEATURES = 5  # models/config.py: the feature layers of a drafter without --num-features


def check_placement(cfg: TrainConfig, roles: list[tuple[str, str]], device: torch.device | None = None) -> None:
    """The job's refusals for a split target, then each target GPU's memory plan, said in one line each.
    device: the one-device path's (resolved --device)."""
    tp = cfg.pipeline.target_tp
    if tp > 1:
        _check_split_job(cfg)
    config = _config(cfg.run.target, tp)
    if config is None:
        return
    if tp > 1:  # an architecture without a plan, or a size that does not divide what it splits
        tensor_plan(config)
        check_tp_size(config, tp)
    devices = [torch.device(d) for role, d in roles if role != "drafter"] or [device]
    shares = not roles or any(role == "both" for role, _ in roles)  # a drafter trains on the same GPU
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        plan = plan_memory(config, tp=tp, device_bytes=available_memory(device), token_budget=cfg.data.token_budget,
                           n_features=(cfg.drafter.num_features or DEFAULT_FEATURES) + (cfg.objective.kd_weight > 0),
                           queue_depth=cfg.pipeline.queue_depth,
                           drafter_parameters=drafter_parameters(config, cfg) if shares else 0,
                           labels=cfg.data.labels == "target", name=cfg.run.target)
        say(f"memory plan of {device}: {plan.describe()}")


def drafter_parameters(config, cfg: TrainConfig) -> int:
    """About the drafter's parameters: its layers shaped as the target's (attention and MLP), and the
    projection of the features into one hidden state; the embedding and LM head are the target's."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    d = head_dim(config)
    kv = cfg.drafter.num_key_value_heads or getattr(config, "num_key_value_heads", None) or heads
    inter = cfg.drafter.intermediate_size or getattr(config, "intermediate_size", 4 * hidden)
    layer = 2 * hidden * heads * d + 2 * hidden * kv * d + 3 * hidden * inter
    return cfg.drafter.num_layers * layer + (cfg.drafter.num_features or DEFAULT_FEATURES) * hidden * hidden


def _check_split_job(cfg: TrainConfig) -> None:
    tp = cfg.pipeline.target_tp
    prepared = (Path(cfg.data.data) / "meta.json").is_file()  # a prepared dataset: nothing to regenerate
    if cfg.data.regenerate and cfg.regeneration.server is None and not prepared:
        raise UsageError(f"--target-tp {tp}: regenerating in this process would hold the whole target on one device; "
                         "give --regen-server URL (a server with its own tensor parallelism) or --no-regenerate")
    if cfg.eval.limit:
        raise UsageError(f"--target-tp {tp}: the evaluation decodes with the whole target on one device; give "
                         "--eval-limit 0, and evaluate the export with `dflash-train eval` where the target fits")


def _config(spec: str, tp: int):
    """The target's transformers config, read without its weights; None where only loading reads it (a GGUF,
    the embedded target: small), which a split target refuses."""
    try:
        return target_config(spec)
    except UsageError:
        if tp > 1:
            raise UsageError(f"--target-tp {tp}: a split target is an HF model directory with safetensors weights "
                             f"or random:<preset>, not {spec}") from None
        return None
