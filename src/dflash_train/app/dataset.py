"""The train job's data: conversations -> target-regenerated replies -> tokenized dataset.

Each stage is cached in the run directory under a key of its settings, so a second run with the
same data settings goes straight to training; --data may also name a prepared dataset.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_train.app.phases import Phases
from dflash_train.data.dataset import LABELS, PreparedDataset, prepare_dataset
from dflash_train.data.parallel import default_workers
from dflash_train.data.regen_client import regenerate_via_server
from dflash_train.data.regen_common import RegenConfig, RegenReport, read_regenerated, sample_ids
from dflash_train.data.regenerate import regenerate
from dflash_train.data.selection import select_conversations
from dflash_train.data.sources import Conversation, SourceReport, default_split, iter_conversations
from dflash_train.errors import say
from dflash_train.models.targets import Target
from dflash_train.objective.objective import feature_layer_ids
from dflash_train.training.config import TrainConfig


def _key(*parts: object) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]


def build_dataset(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool,
                  phases: Phases | None = None) -> PreparedDataset:
    """The prepared data (open_prepared: with labels.npy's target labels where --labels target finds them).
    phases: times its stages (select, regenerate, prepare)."""
    phases = phases or Phases()
    dataset = open_prepared(cfg, _prepared(cfg, target, run_dir, progress, phases).path)
    if cfg.labels == "target":
        say("labels: the target's greedy tokens, " + ("from the data's labels.npy" if dataset.labels is not None else
                                                      "computed in the training forward (pipeline/features.py)"))
    return dataset


def open_prepared(cfg: TrainConfig, path: str | Path) -> PreparedDataset:
    """The prepared dataset at `path`, with its labels.npy mapped when --labels target and it has one.
    Without one the target's feature forward computes the labels as it goes (feature_layers): the same
    tokens as `dflash-train relabel`, without a pass of its own over the data (~54 s of the H200 recipe's)."""
    return PreparedDataset.open(path, labels=cfg.labels == "target" and (Path(path) / LABELS).is_file())


def feature_layers(cfg: TrainConfig, drafter_config, dataset: PreparedDataset) -> list[int]:
    """What each pack's features carry: the drafter's target layers, the target's last one with --kd-weight,
    and the target's labels (TARGET_LABELS) with --labels target on data without labels.npy."""
    return feature_layer_ids(drafter_config, cfg.kd_weight > 0, cfg.labels == "target" and dataset.labels is None)


def _prepared(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool, phases: Phases) -> PreparedDataset:
    """Regenerate (optionally) and tokenize the training conversations; reuse cached stages."""
    if (Path(cfg.data) / "meta.json").is_file():  # already a prepared dataset
        return PreparedDataset.open(cfg.data)
    limit = cfg.num_conversations or None
    split = default_split(cfg.data)
    src_key = _key(cfg.data, limit, cfg.on_bad, target.spec, cfg.data_topic,
                   cfg.regen_max_prompt_tokens if cfg.regenerate else None,
                   *([split] if split != "train" else []))  # files used whole: not the old 98% caches
    # the sample count joins the keys only when > 1, so the caches of earlier runs stay valid
    regen_key = (cfg.regen_max_new_tokens, cfg.regen_temperature, cfg.regen_max_turns,
                 *([cfg.regen_samples] if cfg.regen_samples > 1 else []),
                 *([cfg.max_length] if cfg.regen_max_turns != 1 else []),  # later turns stop at the window
                 *([cfg.regen_server, cfg.regen_model] if cfg.regen_server else []))  # old cache keys unchanged
    data_dir = run_dir / f"data-{_key(src_key, cfg.regenerate, *regen_key, cfg.max_length)}"
    if (data_dir / "meta.json").is_file():
        say(f"using the prepared data in {data_dir}")
        return PreparedDataset.open(data_dir)
    report = SourceReport()
    with phases.time("select"):
        convs = select_conversations(iter_conversations(cfg.data, split=split, on_bad=cfg.on_bad, report=report,
                                                        require_assistant=not cfg.regenerate), report,
                                     topic=cfg.data_topic, limit=cfg.num_conversations,
                                     target=target if cfg.regenerate else None,
                                     max_prompt_tokens=cfg.regen_max_prompt_tokens)
    say(f"data: {report.summary()}")
    if cfg.regenerate:
        regen_path = run_dir / f"regenerated-{_key(src_key, *regen_key)}.jsonl"
        regen_cfg = RegenConfig(max_new_tokens=cfg.regen_max_new_tokens, temperature=cfg.regen_temperature,
                                batch_size=cfg.regen_batch_size, max_turns=cfg.regen_max_turns, seed=cfg.seed,
                                samples=cfg.regen_samples, max_context=cfg.max_length)
        with phases.time("regenerate"):
            rep = _regenerate(cfg, target, convs, regen_path, regen_cfg, progress)
        say(f"regenerate: {rep.summary()}")
        convs = read_regenerated(regen_path, sample_ids([c.id for c in convs], cfg.regen_samples))
    with phases.time("prepare"):
        prep = prepare_dataset(target.tokenizer, convs, data_dir, max_length=cfg.max_length, on_bad=cfg.on_bad,
                               target_spec=target.spec, source_summary=report.summary, overwrite=True,
                               workers=default_workers())
    say(f"prepare: {prep.summary()}")
    return PreparedDataset.open(data_dir)


def _regenerate(cfg: TrainConfig, target: Target, convs: list[Conversation], path: Path, regen_cfg: RegenConfig,
                progress: bool) -> RegenReport:
    """The target writes the replies: in this process, or through --regen-server."""
    if not cfg.regen_server:
        say(f"regenerating {len(convs)} conversations with the target into {path}")
        return regenerate(target, convs, path, regen_cfg, progress=progress)
    server = cfg.server_config()
    say(f"regenerating {len(convs)} conversations through {server.url} into {path}")
    return regenerate_via_server(convs, path, regen_cfg, server, tokenizer=target.tokenizer, tokenizer_name=target.spec,
                                 progress=progress)
