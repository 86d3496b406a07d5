"""The `dflash-train` command.

    dflash-train init-drafter --target smollm2-135m --num-layers 1 --block-size 8 --out runs/untrained
    dflash-train eval --target smollm2-135m --drafter runs/untrained --dataset humaneval --limit 3 \\
        --max-new-tokens 48 --temperature 0 --json out.json

Usage errors print one line naming the flag, field or file and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dflash_train.app.drafter import check_init_drafter_shape, check_num_features
from dflash_train.app.train import run as run_train
from dflash_train.bench.config import BenchConfig
from dflash_train.bench.run import run_bench
from dflash_train.config import FLEX_OPTIONS_ENV, TRACEBACK_ENV
from dflash_train.data.dataset import prepare_dataset
from dflash_train.data.parallel import default_workers
from dflash_train.data.regen_client import regenerate_via_server, server_config
from dflash_train.data.regenerate import regenerate
from dflash_train.data.relabel import PACKED_TOKENS, PADDED_TOKENS, relabel
from dflash_train.data.sources import SourceReport, default_split, iter_conversations
from dflash_train.decode.limits import check_decode
from dflash_train.devices import resolve_device
from dflash_train.errors import UsageError
from dflash_train.eval.evaluate import evaluate
from dflash_train.eval.prompts import load_eval_set
from dflash_train.models.chat import render_chat
from dflash_train.models.checkpoint import check_replaceable, load_drafter, parse_dtype, save_drafter
from dflash_train.models.factory import check_compatible, drafter_config_for, new_drafter, to_device
from dflash_train.models.loading import load_target, load_tokenizer
from dflash_train.profiling.compare import compare as compare_profiles
from dflash_train.profiling.report import report as profile_report
from dflash_train.settings import subcommands as uses
from dflash_train.settings.commands import Use, add_flags, build_sections, given
from dflash_train.settings.sections import RunConfig
from dflash_train.settings.tree import TRAIN, TrainConfig, read_toml
from dflash_train.training.replay import replay_commits


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (no usage dump)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(message)


BENCH = (Use("bench", BenchConfig),)


def _sections(args, command: tuple[Use, ...]) -> dict:
    """The sections of `command` from its parsed flags."""
    return build_sections(command, given(args))


def _load_target(run: RunConfig):
    dtype = parse_dtype(run.dtype) if run.dtype else None
    return load_target(run.target, device=resolve_device(run.device), dtype=dtype, seed=run.target_seed)


def _check_output_file(path: str, flag: str) -> None:
    """Fail before the work, not after it: the output must be a file path we can write."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{flag} {out}: is a directory (give a file path)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {out}: cannot create {out.parent} ({e.strerror or e})") from None
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise UsageError(f"{flag} {out}: not writable")


def cmd_init_drafter(args) -> int:
    sections = _sections(args, uses.INIT_DRAFTER)
    run, shape = sections["run"], sections["drafter"]
    parse_dtype(args.save_dtype, "--save-dtype")
    check_replaceable(Path(args.out), "--out")  # before loading the target: a wrong --out costs nothing
    target = _load_target(run)
    check_num_features(target, shape.num_features, hint="; or name them with --target-layer-ids")
    cfg = drafter_config_for(target, num_layers=shape.num_layers, block_size=shape.block_size,
                             num_features=shape.num_features, target_layer_ids=shape.target_layer_ids,
                             mask_token_id=shape.mask_token_id, sliding_window=shape.sliding_window,
                             num_sliding_layers=shape.sliding_layers, intermediate_size=shape.intermediate_size,
                             num_key_value_heads=shape.num_key_value_heads,
                             dtype=args.save_dtype)
    model = new_drafter(cfg, run.seed)
    out = save_drafter(model, args.out, parse_dtype(args.save_dtype, "--save-dtype"), flag="--out")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote untrained drafter ({n_params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, "
          f"B={cfg.block_size}, target layers {cfg.target_layer_ids}, mask token {cfg.mask_token_id}) to {out}")
    return 0


def _add_bench_args(p) -> None:
    add_flags(p, BENCH)
    p.add_argument("--json", default=None, help="write the results here (with --command recorded)")


def cmd_bench(args) -> int:
    cfg = _sections(args, BENCH)["bench"]
    result = run_bench(cfg)
    result["date"] = time.strftime("%Y-%m-%d")
    result["command"] = "dflash-train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


def cmd_profile_report(args) -> int:
    out = Path(args.out) if args.out else None
    if args.compare:
        text, png = compare_profiles(Path(args.run_dir), Path(args.compare), out)
    else:
        text, png = profile_report(Path(args.run_dir), out)
    print(text)
    print(f"wrote {png}")
    return 0


def cmd_eval(args) -> int:
    sections = _sections(args, uses.EVAL)
    cfg = sections["eval"]
    if args.json:
        _check_output_file(args.json, "--json")
    evalset = load_eval_set(cfg.dataset, cfg.limit)  # fail on bad data before loading models
    target = _load_target(sections["run"])
    drafter = load_drafter(args.drafter)
    check_compatible(drafter, target)
    drafter = to_device(drafter, target)
    ids = [render_chat(target, m) for m in evalset.prompts]
    check_decode(target, drafter, ids, cfg.max_new_tokens, cfg.block_size)  # before the caches are sized
    report = evaluate(target, drafter, ids, cfg, progress=not args.quiet, replay=replay_commits)
    if evalset.categories:
        report.tau_by_category = report.by_category(evalset.categories)
    print(report.summary())
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.require_lossless and report.lossless == "mismatch":
        return 1  # ties (numerics) pass; a real divergence fails the check
    return 0


def cmd_train(args) -> int:
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the checkpoints in --run-dir, --overwrite discards them: give one")
    cfg = _train_config(args)
    return run_train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.quiet)


def _train_config(args) -> TrainConfig:
    """Defaults < --config FILE (or, on --resume, the run's own config.toml) < flags."""
    base = read_toml(args.config) if args.config else {}
    flags = given(args)
    drafter_given = set(base.get("drafter", {})) | set(flags.get("drafter", {}))  # the user's, not the run's saved
    if args.resume and not args.config:
        run_dir = flags.get("run", {}).get("run_dir") or RunConfig().run_dir
        saved = Path(run_dir) / "config.toml"
        if saved.is_file():
            base = read_toml(saved)  # resume with the run's own settings unless overridden
    values = {section: base.get(section, {}) | flags.get(section, {}) for section in base.keys() | flags.keys()}
    cfg = TrainConfig.from_tree(values)
    init = cfg.drafter.init_drafter
    if not (args.resume and init and not Path(init).is_dir()):  # gone: the checkpoint has it
        check_init_drafter_shape(cfg, drafter_given)
    return cfg


def cmd_prepare(args) -> int:
    sections = _sections(args, uses.PREPARE)
    data = sections["data"]
    target = _load_target(sections["run"])
    report = SourceReport()
    convs = _conversations(data, report)
    prep = prepare_dataset(target.tokenizer, convs, args.out, max_length=data.max_length, on_bad=data.on_bad,
                           target_spec=target.spec, source_summary=report.summary, overwrite=args.overwrite,
                           workers=default_workers())
    print(f"source: {report.summary()}")
    print(f"prepared: {prep.summary()} -> {args.out}")
    return 0


def _conversations(data, report: SourceReport, **kw):
    return iter_conversations(data.data, split=data.split or default_split(data.data), on_bad=data.on_bad,
                              limit=data.num_conversations or None, report=report, **kw)


def cmd_relabel(args) -> int:
    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise UsageError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    target = _load_target(_sections(args, uses.RELABEL)["run"])
    rep = relabel(target, args.data, batch_tokens=args.batch_tokens, progress=not args.quiet)
    print(f"relabelled: {rep.summary()} -> {Path(args.data) / 'labels.npy'}")
    return 0


def cmd_regenerate(args) -> int:
    sections = _sections(args, uses.REGENERATE)
    run, cfg = sections["run"], sections["regeneration"]
    server = server_config(cfg) if cfg.server is not None else None
    if server is not None:
        server.api_key()  # a missing key variable fails before the tokenizer loads
    report = SourceReport()
    convs = _conversations(sections["data"], report, require_assistant=False)
    if server is not None:
        tokenizer = load_tokenizer(run.target) if run.target else None  # re-tokenises replies; no weights
        rep = regenerate_via_server(convs, Path(args.out), cfg, server, tokenizer=tokenizer,
                                    tokenizer_name=run.target, progress=not args.quiet)
    else:
        run.target = run.target or RunConfig().target
        rep = regenerate(_load_target(run), convs, Path(args.out), cfg, progress=not args.quiet)
    print(f"source: {report.summary()}")
    print(f"regenerated: {rep.summary()} -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-train", description="Train and evaluate DFlash draft models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("init-drafter", help="write an untrained drafter for a target (reference format)")
    add_flags(p, uses.INIT_DRAFTER)
    p.add_argument("--save-dtype", default="bfloat16", help="dtype of the written weights (default bfloat16)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_init_drafter)

    p = sub.add_parser("eval", help="speculative decoding with a drafter: tau, acceptance, speedup, lossless check")
    add_flags(p, uses.EVAL)
    p.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--require-lossless", action="store_true", help="exit 1 when a T=0 output leaves the target's "
                   "own beyond a numerical tie (lossless: mismatch); ties-only passes")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("train", help="regenerate data, train a drafter, export it and report tau before/after "
                       "(no arguments: the embedded default)")

    p.add_argument("--config", default=None, help="TOML file of options (flags override it)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over: delete the earlier run's outputs that --run-dir's .dflash-train.json lists and "
                        "that still look like the tool's (docs/training.md); the data caches stay")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_flags(p, TRAIN, suppress=True)  # only the flags given override the config file
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="measure the training pipeline on a random target of real shapes "
                       "(tokens/s, MFU, overlap vs sequential, profiling overhead)")
    _add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("profile-report", help="summary table, verdict history and a PNG from RUN_DIR/profile.jsonl")
    p.add_argument("run_dir", help="a run directory trained with --profile-interval (or DFLASH_PROFILE_INTERVAL)")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/profile.png; "
                   "with --compare RUN_B/profile-compare.png)")
    p.add_argument("--compare", default=None, metavar="RUN_B",
                   help="compare RUN_B against RUN_DIR: per-stage deltas ranked by their share of the "
                        "throughput change")
    p.set_defaults(func=cmd_profile_report)

    p = sub.add_parser("prepare",
                       help="tokenize conversations with the target's chat template (loss on assistant turns)")
    add_flags(p, uses.PREPARE)
    p.add_argument("--out", required=True, help="output directory of the prepared dataset")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it holds a prepared dataset that dflash-train wrote")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("regenerate", help="let the target write the assistant turns, in-process or through an "
                       "OpenAI-compatible server (--server; resumable JSONL)")
    add_flags(p, uses.REGENERATE)
    p.add_argument("--out", required=True, help="output JSONL (a rerun continues where it stopped)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("relabel", help="add the target's teacher-forced greedy tokens to a prepared dataset "
                                       "(labels.npy, for train --labels target)")
    add_flags(p, uses.RELABEL)
    p.add_argument("--data", required=True, help="a prepared dataset directory (dflash-train prepare --out)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help=f"tokens per target forward: a packed row on CUDA for a full-attention target "
                        f"(default {PACKED_TOKENS}), else a padded batch (default {PADDED_TOKENS})")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_relabel)
    return parser


def _quiet_libraries() -> None:
    """Our own progress bars and messages are the ones a user should read."""
    # Set, so a fork (a compiler's subprocess) after a batch encode prints no warning. True, not false: a
    # fast tokenizer encodes and decodes a batch on every core, and the job renders, selects and prepares
    # in batches. False made every batch single-threaded: regeneration's prompt rendering took 36 s of the
    # H200 recipe's 197 (16.2M prompt tokens on one of 16 cores). The processes we start are spawned,
    # never forked with the tokenizer's threads (data/parallel.py, pipeline/launcher.py).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _quiet_libraries()
        args = build_parser().parse_args(argv)
        FLEX_OPTIONS_ENV.json_object()  # read deep inside a training step: a bad value is refused here, before any work
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except UsageError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        # A full disk, a read-only or missing path, a directory where a file goes: the user's to fix,
        # so one line naming the path (DFLASH_TRAIN_TRACEBACK=1 shows where it happened).
        if TRACEBACK_ENV.flag(default=False):
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"dflash-train: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
