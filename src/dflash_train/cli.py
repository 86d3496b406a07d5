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
from dataclasses import fields
from pathlib import Path

from dflash_train.app.drafter import check_init_drafter_shape, check_num_features
from dflash_train.app.train import run as run_train
from dflash_train.bench.config import BenchConfig
from dflash_train.bench.run import run_bench
from dflash_train.config import (
    BLOCK_SIZE,
    EVAL_MAX_NEW_TOKENS,
    INTERMEDIATE_SIZE,
    NUM_FEATURES,
    NUM_LAYERS,
    REGEN_MAX_NEW_TOKENS,
    RELEASED,
    SEED,
    TRACEBACK_ENV,
    add_arguments,
    check,
)
from dflash_train.data.dataset import prepare_dataset
from dflash_train.data.parallel import default_workers
from dflash_train.data.regen_client import ServerConfig, load_tokenizer, parse_template_kwargs, regenerate_via_server
from dflash_train.data.regen_common import RegenConfig
from dflash_train.data.regenerate import regenerate
from dflash_train.data.relabel import PACKED_TOKENS, PADDED_TOKENS, relabel
from dflash_train.data.sources import SourceReport, default_split, iter_conversations
from dflash_train.decode.limits import check_decode
from dflash_train.devices import resolve_device
from dflash_train.errors import UsageError
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.eval.prompts import load_eval_set
from dflash_train.models.checkpoint import check_replaceable, load_drafter, parse_dtype, save_drafter
from dflash_train.models.factory import check_compatible, drafter_config_for, new_drafter, to_device
from dflash_train.models.targets import load_target
from dflash_train.profiling.compare import compare as compare_profiles
from dflash_train.profiling.report import report as profile_report
from dflash_train.training import config as train_config


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 (no usage dump)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(message)


def _load_target(args):
    dtype = parse_dtype(args.dtype) if args.dtype else None
    return load_target(args.target, device=resolve_device(args.device), dtype=dtype, seed=args.target_seed)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _check_seed(seed: int) -> None:
    check(SEED, seed, "--seed")  # numpy's seed sequences take no negative seeds; fail here, not deep in a run


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
    check(NUM_LAYERS, args.num_layers, "--num-layers")
    check(BLOCK_SIZE, args.block_size, "--block-size")
    check(NUM_FEATURES, args.num_features, "--num-features")
    if args.num_features is not None and args.target_layer_ids is not None:
        raise UsageError("--num-features and --target-layer-ids: give one (the ids fix the number of features)")
    check(INTERMEDIATE_SIZE, args.intermediate_size, "--intermediate-size")
    _check_seed(args.seed)
    parse_dtype(args.save_dtype, "--save-dtype")
    check_replaceable(Path(args.out), "--out")  # before loading the target: a wrong --out costs nothing
    target = _load_target(args)
    check_num_features(target, args.num_features, hint="; or name them with --target-layer-ids")
    cfg = drafter_config_for(target, num_layers=args.num_layers, block_size=args.block_size,
                             num_features=args.num_features, target_layer_ids=args.target_layer_ids,
                             mask_token_id=args.mask_token_id, sliding_window=args.sliding_window,
                             num_sliding_layers=args.sliding_layers, intermediate_size=args.intermediate_size,
                             dtype=args.save_dtype)
    model = new_drafter(cfg, args.seed)
    out = save_drafter(model, args.out, parse_dtype(args.save_dtype, "--save-dtype"), flag="--out")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote untrained drafter ({n_params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers, "
          f"B={cfg.block_size}, target layers {cfg.target_layer_ids}, mask token {cfg.mask_token_id}) to {out}")
    return 0


def _add_bench_args(p) -> None:
    add_arguments(p, BenchConfig)
    p.add_argument("--json", default=None, help="write the results here (with --command recorded)")


def cmd_bench(args) -> int:
    cfg = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
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
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     block_size=args.block_size, seed=args.seed, baseline=not args.no_baseline,
                     compile=args.compile)
    _check_seed(args.seed)
    if args.json:
        _check_output_file(args.json, "--json")
    evalset = load_eval_set(args.dataset, args.limit)  # fail on bad data before loading models
    target = _load_target(args)
    drafter = load_drafter(args.drafter)
    check_compatible(drafter, target)
    drafter = to_device(drafter, target)
    ids = [target.render_chat(m) for m in evalset.prompts]
    check_decode(target, drafter, ids, cfg.max_new_tokens, cfg.block_size)  # before the caches are sized
    report = evaluate(target, drafter, ids, cfg, progress=not args.quiet)
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


def _train_config(args) -> train_config.TrainConfig:
    """Defaults < --config FILE (or, on --resume, the run's own config.toml) < flags."""
    base = train_config.read_toml(args.config) if args.config else {}
    explicit = set(base) | set(train_config.given(args))  # the user's own file and flags, not the run's saved one
    if args.resume and not args.config:
        run_dir = getattr(args, "run_dir", None) or base.get("run_dir") or train_config.TrainConfig().run_dir
        saved = Path(run_dir) / "config.toml"
        if saved.is_file():
            base = train_config.read_toml(saved)  # resume with the run's own settings unless overridden
    cfg = train_config.from_args(args, base)
    if not (args.resume and cfg.init_drafter and not Path(cfg.init_drafter).is_dir()):  # gone: the checkpoint has it
        check_init_drafter_shape(cfg, explicit)
    return cfg


def cmd_prepare(args) -> int:
    if args.max_length < 2:
        raise UsageError(f"--max-length must be >= 2, got {args.max_length}")
    target = _load_target(args)
    report = SourceReport()
    convs = iter_conversations(args.data, split=args.split or default_split(args.data), on_bad=args.on_bad,
                               limit=args.limit, report=report)
    prep = prepare_dataset(target.tokenizer, convs, args.out, max_length=args.max_length, on_bad=args.on_bad,
                           target_spec=target.spec, source_summary=report.summary, overwrite=args.overwrite,
                           workers=default_workers())
    print(f"source: {report.summary()}")
    print(f"prepared: {prep.summary()} -> {args.out}")
    return 0


def cmd_relabel(args) -> int:
    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise UsageError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    target = _load_target(args)
    rep = relabel(target, args.data, batch_tokens=args.batch_tokens, progress=not args.quiet)
    print(f"relabelled: {rep.summary()} -> {Path(args.data) / 'labels.npy'}")
    return 0


def cmd_regenerate(args) -> int:
    _check_seed(args.seed)
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                      max_turns=args.max_turns, seed=args.seed, samples=args.samples, max_context=args.max_context)
    if args.server is None:
        for flag, value in (("--model", args.model), ("--api-key-env", args.api_key_env),
                            ("--chat-template-kwargs", args.chat_template_kwargs)):
            if value is not None:
                raise UsageError(f"{flag} needs --server (the in-process path runs --target itself)")
    report = SourceReport()
    convs = iter_conversations(args.data, split=args.split or default_split(args.data), on_bad=args.on_bad,
                               limit=args.limit, report=report,
                               require_assistant=False)
    if args.server is not None:
        rep = _regenerate_via_server(args, cfg, convs)
    else:
        args.target = args.target or "smollm2-135m"
        target = _load_target(args)
        rep = regenerate(target, convs, Path(args.out), cfg, progress=not args.quiet)
    print(f"source: {report.summary()}")
    print(f"regenerated: {rep.summary()} -> {args.out}")
    return 0


def _regenerate_via_server(args, cfg, convs):
    server = ServerConfig(url=args.server, model=args.model, concurrency=args.concurrency,
                          api_key_env=args.api_key_env, reasoning=args.reasoning,
                          chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
                          request_timeout=args.request_timeout, retries=args.retries, max_failures=args.max_failures)
    server.api_key()  # a missing key variable fails before the tokenizer loads
    tokenizer = load_tokenizer(args.target) if args.target else None  # re-tokenises replies; no weights
    return regenerate_via_server(convs, Path(args.out), cfg, server, tokenizer=tokenizer,
                                 tokenizer_name=args.target, progress=not args.quiet)


def _add_source_args(p: argparse.ArgumentParser, on_bad_default: str = "error") -> None:
    p.add_argument("--data", default="sharegpt", help="sharegpt (embedded) or a .json/.jsonl file of conversations")
    p.add_argument("--split", default=None, help="train, held-out or all (default: train for the embedded "
                   "sharegpt, whose held-out 2%% eval uses; all for a file of your own)")
    p.add_argument("--limit", type=int, default=None, help="use at most this many conversations")
    p.add_argument("--on-bad", default=on_bad_default, help="error: stop at the first bad record (file:line); "
                   "skip: skip and count bad records")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m",
                   help="smollm2-135m (embedded), random:<preset>, a .gguf file, an HF directory or a hub id")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default=None, help="target compute dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--target-seed", type=int, default=0, help="weights seed for random:<preset> targets")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-train", description="Train and evaluate DFlash draft models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("init-drafter", help="write an untrained drafter for a target (reference format)")
    _add_target_args(p)
    p.add_argument("--num-layers", type=int, default=NUM_LAYERS.default,
                   help=f"draft layers (default {NUM_LAYERS.default})")
    p.add_argument("--block-size", type=int, default=RELEASED["block_size"],
                   help=f"block size B (default {RELEASED['block_size']}, the released drafters')")
    p.add_argument("--num-features", type=int, default=None, help=NUM_FEATURES.help)
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="explicit feature layers, e.g. 1,9,17")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: first spare embedding row, "
                   "else an unused special token")
    p.add_argument("--sliding-layers", type=int, default=0, help="number of sliding-window draft layers (first ones)")
    p.add_argument("--sliding-window", type=int, default=None, help="window of the sliding layers")
    p.add_argument("--intermediate-size", type=int, default=INTERMEDIATE_SIZE.default, help=INTERMEDIATE_SIZE.help)
    p.add_argument("--save-dtype", default="bfloat16", help="dtype of the written weights (default bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_init_drafter)

    p = sub.add_parser("eval", help="speculative decoding with a drafter: tau, acceptance, speedup, lossless check")
    _add_target_args(p)
    p.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors)")
    p.add_argument("--dataset", default="humaneval", help="humaneval, mtbench, sharegpt (held-out) or a .jsonl file")
    p.add_argument("--limit", type=int, default=10, help="number of prompts (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=EVAL_MAX_NEW_TOKENS.default,
                   help=f"{EVAL_MAX_NEW_TOKENS.help} (default {EVAL_MAX_NEW_TOKENS.default})")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="verify block size (default: the drafter's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--require-lossless", action="store_true", help="exit 1 when a T=0 output leaves the target's "
                   "own beyond a numerical tie (lossless: mismatch); ties-only passes")
    p.add_argument("--no-baseline", action="store_true", help="tau only: skip target-only decoding (no speedup, "
                   "no lossless check; about half the time)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode steps of the target and the "
                   "drafter (both target-only and DFlash decoding; about 2x fewer kernels per step on CUDA; the "
                   "warm-up compiles, so the clocks exclude it)")
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
    train_config.add_arguments(p)
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
    _add_target_args(p)
    _add_source_args(p)
    p.add_argument("--max-length", type=int, default=2048, help="truncate sequences to this many tokens")
    p.add_argument("--out", required=True, help="output directory of the prepared dataset")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it holds a prepared dataset that dflash-train wrote")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("regenerate", help="let the target write the assistant turns, in-process or through an "
                       "OpenAI-compatible server (--server; resumable JSONL)")
    _add_target_args(p)
    p.set_defaults(target=None)  # in-process: smollm2-135m; with --server: only re-tokenises the replies
    _add_source_args(p)
    p.add_argument("--max-new-tokens", type=int, default=REGEN_MAX_NEW_TOKENS.default,
                   help=f"{REGEN_MAX_NEW_TOKENS.help} (default {REGEN_MAX_NEW_TOKENS.default})")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=16,
                   help="prompts per batched decode, sorted by length across 16 batches of conversations (in-process)")
    p.add_argument("--max-turns", type=int, default=None, help="assistant turns regenerated per conversation")
    p.add_argument("--max-context", type=int, default=None,
                   help="end a conversation before a later turn whose prompt has this many tokens or more "
                   "(with --server, counted by --target's tokenizer)")
    p.add_argument("--samples", type=int, default=1, help="replies sampled per conversation, written as ID#0.. "
                   "(> 1 needs --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output JSONL (a rerun continues where it stopped)")
    p.add_argument("--quiet", action="store_true")
    g = p.add_argument_group("server", "regenerate through an OpenAI-compatible server (vLLM, SGLang, llama.cpp) "
                             "instead of in-process; --target, if given, only re-tokenises the replies")
    g.add_argument("--server", default=None, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name as the server lists it (default: its only model)")
    g.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    g.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--reasoning", default="keep", choices=("keep", "drop"),
                   help="reasoning text: keep it inline in <think>...</think> (default) or drop it")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before a retry")
    g.add_argument("--retries", type=int, default=4, help="retries per request on timeouts, dropped "
                   "connections, 429 and 5xx (exponential backoff)")
    g.add_argument("--max-failures", type=int, default=8, help="stop after this many requests in a row "
                   "failed for good (circuit breaker)")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("relabel", help="add the target's teacher-forced greedy tokens to a prepared dataset "
                                       "(labels.npy, for train --labels target)")
    _add_target_args(p)
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
