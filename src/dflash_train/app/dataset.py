"""The train job's data: conversations -> target-regenerated replies -> tokenized dataset.

Each stage is cached in the run directory under a key of what it is made from: the bytes of the
--data file, the tokenizer, the target and the settings that shape it (never the --data path, which
can name another file tomorrow or in another directory). A second run on the same inputs goes
straight to training, and says which input changed when it cannot; --data may also name a prepared dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from dflash_train.app.phases import Phases
from dflash_train.data.dataset import LABELS, PreparedDataset, prepare_dataset
from dflash_train.data.fingerprint import source_fingerprint, target_fingerprint
from dflash_train.data.parallel import default_workers
from dflash_train.data.regen_client import regenerate_via_server, server_config
from dflash_train.data.regen_common import RegenConfig, RegenReport, read_regenerated, sample_ids, without_credentials
from dflash_train.data.regenerate import regenerate
from dflash_train.data.selection import select_conversations
from dflash_train.data.sources import Conversation, SourceReport, default_split, iter_conversations
from dflash_train.errors import UsageError, say
from dflash_train.files import write_atomic
from dflash_train.models.chat import tokenizer_fingerprint
from dflash_train.models.target import Target
from dflash_train.objective.objective import feature_layer_ids
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.settings.tree import REGENERATION, TrainConfig


def build_dataset(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool,
                  phases: Phases | None = None) -> PreparedDataset:
    """The prepared data (open_prepared: with labels.npy's target labels where --labels target finds them).
    phases: times its stages (select, regenerate, prepare)."""
    phases = phases or Phases()
    dataset = open_prepared(cfg, _prepared(cfg, target, run_dir, progress, phases).path)
    if cfg.data.labels == "target":
        say("labels: the target's greedy tokens, " + ("from the data's labels.npy" if dataset.labels is not None else
                                                      "computed in the training forward (pipeline/features.py)"))
    return dataset


def open_prepared(cfg: TrainConfig, path: str | Path) -> PreparedDataset:
    """The prepared dataset at `path`, with its labels.npy mapped when --labels target and it has one.
    Without one the target's feature forward computes the labels as it goes (feature_layers): the same
    tokens as `dflash-train relabel`, without a pass of its own over the data (~54 s of the H200 recipe's)."""
    return PreparedDataset.open(path, labels=cfg.data.labels == "target" and (Path(path) / LABELS).is_file())


def feature_layers(cfg: TrainConfig, drafter_config, dataset: PreparedDataset) -> FeatureSpec:
    """What each pack's features carry: the drafter's target layers, the target's last one with --kd-weight,
    and the target's labels with --labels target on data without labels.npy."""
    return FeatureSpec(tuple(feature_layer_ids(drafter_config, cfg.objective.kd_weight > 0)),
                       labels=cfg.data.labels == "target" and dataset.labels is None)


def _prepared(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool, phases: Phases) -> PreparedDataset:
    """Regenerate (optionally) and tokenize the training conversations; reuse cached stages."""
    if (Path(cfg.data.data) / "meta.json").is_file():  # already a prepared dataset
        return PreparedDataset.open(cfg.data.data)
    split = default_split(cfg.data.data)
    regen_inputs, data_inputs = _cache_inputs(cfg, target, split)
    data_dir = run_dir / f"data-{_key(data_inputs)}"
    if (data_dir / "meta.json").is_file():
        say(f"using the prepared data in {data_dir}: {_same(data_inputs)}")
        return PreparedDataset.open(data_dir)
    _say_why_again("preparing the data", data_inputs, cfg.data.data, run_dir, "data-*", lambda p: p / INPUTS_FILE)
    report = SourceReport()
    with phases.time("select"):
        convs = select_conversations(iter_conversations(cfg.data.data, split=split, on_bad=cfg.data.on_bad,
                                                        report=report,
                                                        require_assistant=not cfg.data.regenerate), report,
                                     topic=cfg.data.data_topic, limit=cfg.data.num_conversations,
                                     target=target if cfg.data.regenerate else None,
                                     max_prompt_tokens=cfg.regeneration.max_prompt_tokens)
    say(f"data: {report.summary()}")
    if cfg.data.regenerate:
        regen_path = run_dir / f"regenerated-{_key(regen_inputs)}.jsonl"
        if regen_path.is_file():  # append-only: the replies already there are kept, the missing ones written
            say(f"continuing the regenerated replies in {regen_path}: {_same(regen_inputs)}")
        else:
            _say_why_again("regenerating the replies", regen_inputs, cfg.data.data, run_dir, "regenerated-*.jsonl",
                           _regen_record)
        _write_record(_regen_record(regen_path), regen_inputs)
        regen_cfg = cfg.regen()
        with phases.time("regenerate"):
            rep = _regenerate(cfg, target, convs, regen_path, regen_cfg, progress)
        say(f"regenerate: {rep.summary()}")
        convs = read_regenerated(regen_path, sample_ids([c.id for c in convs], cfg.regeneration.samples))
    with phases.time("prepare"):
        prep = prepare_dataset(target.tokenizer, convs, data_dir, max_length=cfg.data.max_length,
                               on_bad=cfg.data.on_bad,
                               target_spec=target.spec, source_summary=report.summary, overwrite=True,
                               workers=default_workers(), out_flag="--run-dir")
    _write_record(data_dir / INPUTS_FILE, data_inputs)
    say(f"prepare: {prep.summary()}")
    return PreparedDataset.open(data_dir)


# --- cache keys: what each cached stage was made from ----------------------------------------------

INPUTS_FILE = "inputs.json"  # in data-<key>/ (and as regenerated-<key>.inputs.json): the key's inputs, for messages
_KEY_CHARS = 12  # the path-keyed names of earlier versions had 10: never taken for these, nor deleted


def _key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:_KEY_CHARS]


def _cache_inputs(cfg: TrainConfig, target: Target, split: str) -> tuple[dict, dict]:
    """The inputs of the regenerated replies and of the prepared data: what the conversations, the
    tokenizer and the target hold, by content (data/fingerprint.py, models/chat.py), and the settings that
    shape each."""
    made_from = {"data": source_fingerprint(cfg.data.data), "tokenizer": tokenizer_fingerprint(target.tokenizer),
                 "target": target_fingerprint(target)}
    data, rc = cfg.data, cfg.regeneration
    select = {"--num-conversations": data.num_conversations, "--on-bad": data.on_bad, "--data-topic": data.data_topic,
              "split": split}
    regen = {"--regen-max-prompt-tokens": rc.max_prompt_tokens, "--regen-max-new-tokens": rc.max_new_tokens,
             "--regen-temperature": rc.temperature, "--regen-max-turns": rc.max_turns, "--regen-samples": rc.samples}
    if cfg.regeneration.max_turns != 1:
        regen["--max-length"] = cfg.data.max_length  # later turns stop at the window
    if cfg.regeneration.temperature > 0:
        regen["--seed"] = cfg.run.seed  # sampled replies
    if cfg.regeneration.server:
        regen |= {"--regen-server": without_credentials(rc.server), "--regen-model": rc.model}
    regen_inputs = {**made_from, "settings": {**select, **regen}}
    data_inputs = {**made_from, "settings": {**select, **(regen if cfg.data.regenerate else {}),
                                             "--regenerate": cfg.data.regenerate, "--max-length": cfg.data.max_length}}
    # as a record reads back (tuples become lists), so a fresh key's inputs compare equal to a stored one's
    return json.loads(json.dumps(regen_inputs, default=str)), json.loads(json.dumps(data_inputs, default=str))


def _regen_record(regen_path: Path) -> Path:
    return regen_path.with_name(regen_path.name.removesuffix(".jsonl") + ".inputs.json")


def _write_record(path: Path, inputs: dict) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(inputs, indent=1, sort_keys=True, default=str).encode()))


def _same(inputs: dict) -> str:
    data = inputs["data"]
    what = f"{data['source']} (sha256 {data['sha256'][:12]}…)" if "sha256" in data else data["source"]
    return f"same data file {what}, tokenizer, target and settings"


def _changes(new: dict, old: dict, data_arg: str) -> list[str]:
    """Which of the key's inputs differ, in the user's words."""
    out = []
    if new["data"] != old.get("data"):
        was = old["data"].get("source")
        out.append(f"{data_arg} changed" if was == new["data"]["source"] else f"--data is {data_arg}, not {was}")
    if new["tokenizer"] != old.get("tokenizer"):
        out.append("the tokenizer or its chat template changed")
    if new["target"] != old.get("target"):
        out.append("the target changed")
    theirs = old["settings"]
    out += [f"{k} {theirs.get(k)} -> {v}" for k, v in sorted(new["settings"].items()) if theirs.get(k) != v]
    out += [f"{k} {theirs[k]} -> unset" for k in sorted(set(theirs) - set(new["settings"]))]
    return out


def _say_why_again(doing: str, inputs: dict, data_arg: str, run_dir: Path, pattern: str, record_of) -> None:
    """One line when the run directory holds this stage's cache for other inputs: what differs from the
    closest one, or that the ones there are path-keyed caches of an earlier version (not reused)."""
    earlier = []
    for cache in sorted(run_dir.glob(pattern)):
        try:
            rec = json.loads(record_of(cache).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and all(isinstance(rec.get(k), dict) for k in ("data", "settings")):
            earlier.append((len(changes := _changes(inputs, rec, data_arg)), str(cache), changes))
    if earlier and (closest := min(earlier))[0]:
        say(f"{doing} again: {', '.join(closest[2])} since {closest[1]}")
        return
    stem = pattern.split("*")[0]
    old = sorted(p for p in run_dir.glob(pattern) if re.fullmatch(r"[0-9a-f]{10}", p.name[len(stem):].split(".")[0]))
    if old:
        more = f" and {len(old) - 1} more" if len(old) > 1 else ""
        say(f"{doing}: {old[0]}{more}, keyed by the --data path rather than by what it holds, not reused")


def _regenerate(cfg: TrainConfig, target: Target, convs: list[Conversation], path: Path, regen_cfg: RegenConfig,
                progress: bool) -> RegenReport:
    """The target writes the replies: in this process, or through --regen-server."""
    if not cfg.regeneration.server:
        say(f"regenerating {len(convs)} conversations with the target into {path}")
        try:
            return regenerate(target, convs, path, regen_cfg, progress=progress)
        except UsageError as e:  # its messages name regenerate's flags; here they are --regen-*
            raise UsageError(REGENERATION.renamed(str(e))) from None
    server = server_config(cfg.regeneration)
    say(f"regenerating {len(convs)} conversations through {server.url} into {path}")
    return regenerate_via_server(convs, path, regen_cfg, server, tokenizer=target.tokenizer, tokenizer_name=target.spec,
                                 progress=progress)
