"""Training configuration: one typed dataclass, a TOML file, and CLI flags generated from it.

Precedence: defaults < `--config FILE.toml` < explicit command-line flags. Every field is a
flag (`num_anchors` <-> `--num-anchors`) and a TOML key; each is validated here, and errors
name the option. The resolved configuration is saved as `RUN_DIR/config.toml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_train import config
from dflash_train.config import (
    ATTENTION,
    BLOCK_SIZE,
    EVAL_MAX_NEW_TOKENS,
    GAMMA,
    INTERMEDIATE_SIZE,
    KD_WEIGHT,
    LOSS_CHUNK_ROWS,
    NUM_ANCHORS,
    NUM_FEATURES,
    NUM_LAYERS,
    PROFILE_INTERVAL_ENV,
    REGEN_MAX_NEW_TOKENS,
    SEED,
    AttentionBackend,
    field_types,
    flag,
    knob_field,
    opt,
    validate,
)
from dflash_train.data.regen_client import ServerConfig
from dflash_train.errors import UsageError
from dflash_train.eval.prompts import DATASETS
from dflash_train.objective.objective import ObjectiveConfig
from dflash_train.profiling.session import ProfilingConfig
from dflash_train.profiling.tools import parse_steps


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # --- run -------------------------------------------------------------------------
    run_dir: str = opt("runs/default", "run directory: data cache, checkpoints, metrics, exported drafter")
    target: str = opt("smollm2-135m", "target spec (see `dflash-train eval --help`)")
    device: str = opt("auto", "cpu, cuda, cuda:N or auto")
    seed: int = knob_field(SEED, help="seed for the drafter init, data order and anchors")
    # --- data ------------------------------------------------------------------------
    data: str = opt("sharegpt", "conversations: sharegpt (embedded, train split) or a .json/.jsonl file")
    num_conversations: int = opt(160, "conversations to use from --data (0 = all)")
    data_topic: Literal["code", "any"] = opt("code", "keep only conversations whose first prompt is about: code | any "
                          "(the embedded default evaluates on HumanEval, so it trains on ShareGPT's coding slice)")
    regenerate: bool = opt(True, "let the target rewrite the assistant turns (cached in RUN_DIR/regenerated.jsonl)")
    regen_max_new_tokens: int = knob_field(REGEN_MAX_NEW_TOKENS)
    regen_temperature: float = opt(0.0, "sampling temperature of regeneration (0 = greedy)")
    regen_batch_size: int = opt(32, "prompts per regeneration batch (each turn's prompts sorted by length across "
                                    "16 batches)")
    regen_max_turns: int = opt(1, "assistant turns regenerated per conversation (a later turn is skipped once its "
                                  "prompt reaches --max-length)")
    regen_samples: int = opt(1, "replies sampled per conversation (> 1 needs --regen-temperature > 0)")
    regen_max_prompt_tokens: int = opt(256, "skip conversations whose first prompt is longer (prefill cost)")
    regen_server: str | None = opt(None, "regenerate through this OpenAI-compatible server (vLLM, SGLang, llama.cpp; "
                                   "base URL) instead of in-process; see `dflash-train regenerate --help`")
    regen_model: str | None = opt(None, "model name on --regen-server (default: the only one it serves)")
    regen_concurrency: int = opt(64, "requests in flight to --regen-server")
    regen_api_key_env: str | None = opt(None, "environment variable holding --regen-server's API key")
    labels: Literal["data", "target"] = opt("data", "block labels: data (the text's own tokens) or target (the "
                                            "target's greedy token given the true prefix: computed in training's "
                                            "target forward, or the data's labels.npy from relabel)")
    max_length: int = opt(512, "tokens per training sequence (longer ones are truncated)")
    on_bad: Literal["error", "skip"] = opt("skip", "bad records: skip (counted and reported) or error "
                                                   "(stop at file:line)")
    # --- drafter ---------------------------------------------------------------------
    num_layers: int = knob_field(NUM_LAYERS)
    block_size: int = knob_field(BLOCK_SIZE)
    num_features: int | None = knob_field(NUM_FEATURES)
    init_drafter: str | None = opt(None, "start from this drafter directory instead of a fresh init")
    init_from_target: bool = opt(True, "initialise the draft layers from the target's last layers and final norm "
                                 "(else random); needs matching shapes")
    sliding_layers: int = opt(1, "draft layers (the first ones) with sliding-window attention")
    sliding_window: int | None = opt(16, "window of the sliding-window draft layers")
    intermediate_size: int | None = knob_field(INTERMEDIATE_SIZE)
    # --- objective -------------------------------------------------------------------
    num_anchors: int = knob_field(NUM_ANCHORS)
    gamma: float | None = knob_field(GAMMA)
    attention: AttentionBackend = knob_field(ATTENTION)
    loss_chunk_rows: int = knob_field(LOSS_CHUNK_ROWS)
    kd_weight: float = knob_field(KD_WEIGHT)
    token_budget: int = opt(512, "context tokens packed into one step")
    cache_features: bool | None = opt(None, "compute each sequence's target features once and keep them in the "
                                      "target's device memory (tokens x features x hidden x 2 bytes on a GPU), so the "
                                      "target runs only in the first epoch (default: on for CPU)")
    # --- optimisation ----------------------------------------------------------------
    lr: float = opt(3e-3, "peak learning rate (AdamW; the paper recipe's 6e-4 suits long GPU runs)")
    warmup_ratio: float = opt(0.04, "fraction of steps of linear warm-up before the cosine decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient-norm clip (0 = off)")
    epochs: float = opt(5.0, "passes over the data (ignored when --max-steps > 0)")
    max_steps: int = opt(0, "optimizer steps (0 = derive from --epochs)")
    grad_accum: int = opt(1, "packs per drafter worker per optimizer step (gradient accumulation)")
    compile_target: bool = opt(False, "torch.compile the target's decoder layers for the feature forwards "
                               "(one graph for all layers, compiled once per run)")
    compile_drafter: bool = opt(False, "torch.compile each draft layer's training forward (one graph for all layers, "
                                "FlexAttention traced in; CUDA): fewer launches and host time per step")
    compile_masks: bool = opt(False, "torch.compile the tile computation of the drafter's FlexAttention masks (CUDA): "
                              "~80 launches a mask become a few; experimental, not yet timed")
    # --- pipeline --------------------------------------------------------------------
    target_devices: str | None = opt(None, "devices of the target workers, comma-separated (e.g. cuda:0); "
                                     "with --drafter-devices: one process per device")
    drafter_devices: str | None = opt(None, "devices of the drafter workers, comma-separated (e.g. cuda:1,cuda:2); "
                                      "several = data parallel; the same list as --target-devices = a target and a "
                                      "drafter on every device (whole pipelines, data parallel)")
    overlap: bool | None = opt(None, "a device holding both roles: run the target on its own thread and CUDA "
                               "stream so its forwards fill the drafter's gaps (default: on for CUDA, off for CPU)")
    queue_depth: int = opt(4, "depth of the batch queue and of the feature (hs) queue")
    peer_timeout: float = opt(600.0, "seconds without progress before a worker is reported stuck")
    dist_port: int = opt(0, "TCP port of the torch.distributed rendezvous on this host (0 = a free one)")
    # --- profiling -------------------------------------------------------------------
    profile_interval: float | None = dataclasses.field(  # the environment's default, read when the config is built
        default_factory=PROFILE_INTERVAL_ENV.seconds,
        metadata={"help": "seconds between profile summaries, 0 = off "
                          f"(default ${PROFILE_INTERVAL_ENV.name}; unset = off)"})
    profile_cuda_events: bool = opt(False, "time GPU stages with CUDA events (device time, resolved lazily) "
                                    "instead of host wall clock")
    torch_profile: str | None = opt(None, "START:END steps to record with torch.profiler (a Chrome trace per process "
                                    "in RUN_DIR/traces)")
    memory_history: int = opt(0, "CUDA: keep the last N allocator events with their Python stacks from the start, "
                              "so the out-of-memory snapshot (RUN_DIR/oom-<process>.pickle) shows what allocated each "
                              "block; costs ~2 us of host time per allocation and free and a few KB of host memory "
                              "per entry (100000: a few hundred MB); 0 = off")
    # --- logging and checkpoints -----------------------------------------------------
    log_every: int = opt(10, "steps between metric records")
    checkpoint_every: int = opt(100, "steps between checkpoints (0 = only at the end)")
    keep_checkpoints: int = opt(2, "checkpoints kept in RUN_DIR/checkpoints")
    export_dtype: Literal["float32", "bfloat16"] = opt("float32", "dtype of the exported drafter (float32 | bfloat16)")
    # --- evaluation ------------------------------------------------------------------
    eval_dataset: str = opt("humaneval", "prompts for the before/after tau (humaneval, mtbench, sharegpt, file)")
    eval_limit: int = opt(4, "prompts evaluated before and after training (0 = skip)")
    eval_before: Literal["auto", "yes", "no"] = opt(
        "auto", "tau before training too: auto = only for a drafter that starts trained (--init-drafter); a fresh "
        "one, random or from the target's layers, accepts nothing (tau 1.000 on the H200 and CPU defaults), and its "
        "eval cost the CPU default 129 s")
    eval_max_new_tokens: int = knob_field(EVAL_MAX_NEW_TOKENS)
    val_conversations: int = opt(0, "conversations held out of training; every --val-every steps the records get "
                                 "val_loss, val_acc and val_expected_tau on them (teacher-forced, as the train "
                                 "estimate, but on data never trained on); 0 = none")
    val_every: int = opt(250, "steps between validations (--val-conversations)")

    def __post_init__(self) -> None:
        validate(self)  # the shared knobs (config.py), Literal choices, finite floats
        for name in ("token_budget", "max_length", "log_every", "keep_checkpoints", "regen_batch_size",
                     "regen_max_turns", "regen_samples", "regen_max_prompt_tokens", "regen_concurrency", "grad_accum",
                     "queue_depth", "val_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("num_conversations", "max_steps", "checkpoint_every", "eval_limit", "weight_decay", "grad_clip",
                     "regen_temperature", "memory_history", "val_conversations"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name, what in (("compile_drafter", "compiled draft layers need"), ("compile_masks", "compiled masks are")):
            if getattr(self, name) and (self.device == "cpu" or self.attention == "dense"):
                raise UsageError(f"--{_flag(name)}: {what} FlexAttention on CUDA, not "
                                 + ("--device cpu" if self.device == "cpu" else "--attention dense (its per-sequence "
                                    "segments would recompile for every pack)"))
        if self.sliding_layers < 0 or self.sliding_layers > self.num_layers:
            raise UsageError(f"--sliding-layers must be in 0..--num-layers ({self.num_layers}), "
                             f"got {self.sliding_layers}")
        if self.sliding_layers and not (self.sliding_window or 0) >= 1:
            raise UsageError("--sliding-window must be >= 1 when --sliding-layers > 0")
        if self.regen_samples > 1 and not (self.regenerate and self.regen_temperature > 0):
            raise UsageError(f"--regen-samples {self.regen_samples} needs --regenerate and --regen-temperature > 0 "
                             "(at T=0 every sample is the same)")
        if self.regen_server is not None:
            if not self.regenerate:
                raise UsageError("--regen-server needs --regenerate (the server is what regenerates)")
            self.server_config()  # validates the URL and the rest; errors name the flag
        if self.max_length < self.block_size:
            raise UsageError(f"--max-length {self.max_length} is shorter than a block (--block-size {self.block_size})")
        if self.token_budget < self.max_length:
            raise UsageError(f"--token-budget {self.token_budget} must hold one sequence "
                             f"(--max-length {self.max_length})")
        if not self.peer_timeout > 0:
            raise UsageError(f"--peer-timeout must be > 0 seconds, got {self.peer_timeout}")
        if not 0 <= self.dist_port < 65536:
            raise UsageError(f"--dist-port must be a TCP port (0 = any free one), got {self.dist_port}")
        if (self.target_devices is None) != (self.drafter_devices is None):
            raise UsageError("--target-devices and --drafter-devices go together (or leave both out and use --device)")
        if self.torch_profile is not None:
            self.torch_profile_steps()
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise UsageError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_steps == 0 and not self.epochs > 0:
            raise UsageError("--epochs must be > 0 when --max-steps is 0")
        if self.eval_limit:
            _check_eval_dataset(self.eval_dataset)

    def torch_profile_steps(self) -> tuple[int, int]:
        return parse_steps(self.torch_profile or "", "--torch-profile")

    # --- each component's own section ------------------------------------------------

    def section(self, cls: type[_S]) -> _S:
        """A component's settings: the fields of dataclass `cls`, taken from this config by name (the
        component never sees the rest; defaults and checks stay here)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def trainer(self) -> TrainerConfig:
        return self.section(TrainerConfig)

    def objective(self) -> ObjectiveConfig:
        return self.section(ObjectiveConfig)

    def profiling(self) -> ProfilingConfig:
        return ProfilingConfig(
            interval=self.profile_interval, cuda_events=self.profile_cuda_events,
            torch_profile=self.torch_profile_steps() if self.torch_profile else None,
            memory_history=self.memory_history,
            oom_hint=f"lower --num-anchors ({self.num_anchors}) or --token-budget ({self.token_budget})")

    def server_config(self):
        """The regeneration server's settings (--regen-server ...), checked; errors name train's flags."""
        try:
            return ServerConfig(url=self.regen_server, model=self.regen_model, concurrency=self.regen_concurrency,
                                api_key_env=self.regen_api_key_env)
        except UsageError as e:  # the client names regenerate's flags
            raise UsageError(re.sub(r"--(server|model|concurrency|api-key-env)\b", r"--regen-\1", str(e))) from None

    # --- files -----------------------------------------------------------------------

    def to_toml(self) -> str:
        """One table per section ([run], [data], ...); read_toml also takes the flat keys of older files."""
        lines = ["# dflash-train resolved configuration"]
        for section, names in sections().items():
            values = [(n, getattr(self, n)) for n in names if getattr(self, n) is not None]
            lines += ["", f"[{section}]"] + [f"{n} = {_toml_value(v)}" for n, v in values]
        return "\n".join(lines) + "\n"


_S = typing.TypeVar("_S")


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """The Trainer's own settings: the [optim] section and its logging and checkpoint cadence.
    No defaults: TrainConfig holds them and their checks (TrainConfig.trainer() builds this)."""

    lr: float
    warmup_ratio: float
    weight_decay: float
    grad_clip: float
    grad_accum: int
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int


# The tree's sections, by the first field of each run of fields in TrainConfig's order.
_SECTION_STARTS = {"run_dir": "run", "data": "data", "num_layers": "drafter", "num_anchors": "objective",
                   "lr": "optim", "target_devices": "pipeline", "profile_interval": "profiling", "log_every": "run",
                   "eval_dataset": "eval"}


def sections() -> dict[str, tuple[str, ...]]:
    """Section name -> its fields, in order: run, data, drafter, objective, optim, pipeline, profiling, eval."""
    out: dict[str, list[str]] = {}
    section = "run"
    for f in dataclasses.fields(TrainConfig):
        section = _SECTION_STARTS.get(f.name, section)
        out.setdefault(section, []).append(f.name)
    return {k: tuple(v) for k, v in out.items()}


def _check_eval_dataset(name: str) -> None:
    """Before the target loads; the eval reader's own messages name eval's --dataset."""
    if name in DATASETS or Path(name).is_file():
        return
    if name.endswith((".jsonl", ".json")):
        raise UsageError(f"--eval-dataset: file {name} not found")
    raise UsageError(f"--eval-dataset: unknown dataset {name!r} (choose {', '.join(DATASETS)} or a .jsonl file)")


def _flag(name: str) -> str:
    return flag(name)[2:]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _field_types() -> dict[str, tuple[type, ...]]:
    """Each field's accepted Python types (a TOML value's), from its resolved annotation."""
    types = {}
    for name, tp in field_types(TrainConfig).items():
        base = config.base_type(tp)
        none = (type(None),) if type(None) in typing.get_args(tp) else ()
        types[name] = {float: (float, int)}.get(base, (base,)) + none
    return types


def read_toml(path: str | Path) -> dict[str, Any]:
    """Keys of a flat TOML file, each checked against TrainConfig's fields and types."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--config {path}: is a directory, not a TOML file")
    if not path.is_file():
        raise UsageError(f"--config: {path} not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: invalid TOML ({e})") from None
    types, tree = _field_types(), sections()
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in tree and isinstance(value, dict):  # [section] table
            for name, v in value.items():
                if name not in tree[key]:
                    home = next((s for s, names in tree.items() if name in names), None)
                    raise UsageError(f"{path}: [{key}] has no option {name!r}"
                                     + (f" (it is in [{home}])" if home else ""))
                flat[name] = v
        else:  # a flat key, as files before the sections have them
            flat[key] = value
    for key, value in flat.items():
        if key not in types:
            raise UsageError(f"{path}: unknown option {key!r}")
        ok = types[key]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            raise UsageError(f"{path}: option {key!r} must be {ok[0].__name__}, got {value!r}")
    return flat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; defaults are SUPPRESSed so only explicit flags override the TOML."""
    config.add_arguments(parser, TrainConfig, suppress=True)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (add_arguments leaves the others unset)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def from_args(args: argparse.Namespace, base: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults < base (a TOML's values) < flags given on the command line."""
    return TrainConfig(**((base or {}) | given(args)))
