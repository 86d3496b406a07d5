"""`dflash-train train`: from conversations to an exported, evaluated drafter in one command.

    1. data     conversations (train split) -> target-regenerated replies -> tokenized dataset,
                each stage cached in the run directory under a key of its settings
    2. drafter  a fresh drafter shaped for the target (or --init-drafter, or the checkpoint on --resume)
    3. tau      of the untrained drafter on held-out prompts
    4. train    one device (pipeline/local.py) or one process per device (pipeline/launcher.py):
                checkpoints, metrics.jsonl, TensorBoard, profile summaries
    5. export   RUN_DIR/drafter/ in the reference format, and tau of the trained drafter
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NoReturn

import torch

from dflash_train.devices import resolve_device
from dflash_train.errors import UsageError, say
from dflash_train.eval.evaluate import EvalConfig, EvalReport, evaluate
from dflash_train.eval.prompts import load_prompts
from dflash_train.files import DirectoryLock
from dflash_train.models.checkpoint import check_replaceable, load_config, load_drafter, parse_dtype, save_drafter
from dflash_train.models.config import SLIDING_ATTENTION
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.factory import check_compatible, drafter_config_for, init_from_target, new_drafter
from dflash_train.models.targets import Target, load_target
from dflash_train.training.checkpoint import has_checkpoints, latest_checkpoint, load_state, sweep_temporaries
from dflash_train.objective.objective import check_backend_device
from dflash_train.training.config import TrainConfig

_RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "drafter", "eval_before.json", "eval_after.json",
                "profile.jsonl", "traces", "init_drafter")


def _key(*parts: object) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> tuple[Path, Path | None]:
    """The run directory, ready for this run, and the checkpoint to resume from (None unless --resume)."""
    run_dir = Path(cfg.run_dir)
    if has_checkpoints(run_dir) and not resume:
        if not overwrite:
            raise UsageError(f"--run-dir {run_dir} holds another run's checkpoints; pass --resume to continue it "
                             "or --overwrite to start over")
        for name in _RUN_OUTPUTS:  # keep the data caches: they are keyed by their settings
            path = run_dir / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    removed = sweep_temporaries(run_dir)  # we hold the run directory's lock: nobody else is writing them
    if removed:
        say(f"removed {len(removed)} leftover(s) of interrupted writes: {', '.join(removed[:3])}"
            + (" ..." if len(removed) > 3 else ""))
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise UsageError(f"--resume: {run_dir} has no checkpoint to resume from")
    if ckpt is not None and not cfg.init_drafter:  # with --init-drafter that drafter set the shape, not these flags
        check_resume_shape(cfg, load_config(ckpt / "drafter", "--resume"))  # before config.toml is rewritten
    for name in ("drafter", "init_drafter"):  # refused now rather than after the training
        check_replaceable(run_dir / name, "--run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    return run_dir, ckpt


def check_resume_shape(cfg: TrainConfig, saved) -> None:
    """--resume continues the checkpoint's drafter: flags that would shape another one are refused, by name."""
    sliding = sum(t == SLIDING_ATTENTION for t in saved.layer_types)
    theirs = {"num_layers": saved.num_hidden_layers, "block_size": saved.block_size, "sliding_layers": sliding,
              "num_features": len(saved.target_layer_ids)}
    if sliding:
        theirs["sliding_window"] = saved.sliding_window
    ours = {k: getattr(cfg, k) for k in theirs}
    if ours["num_features"] is None:  # unset: the default, whatever the checkpoint has
        ours["num_features"] = theirs["num_features"]
    bad = [f"--{k.replace('_', '-')} {ours[k]} (the checkpoint's: {v})" for k, v in theirs.items() if ours[k] != v]
    if bad:
        raise UsageError(f"--resume: {', '.join(bad)}; a resumed run trains the checkpoint's drafter: drop these "
                         "flags, or start a new --run-dir")


def build_dataset(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool):
    """The prepared data, with the target's labels when --labels target (computed once, then cached)."""
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.data.relabel import relabel

    dataset = _prepared(cfg, target, run_dir, progress)
    if cfg.labels != "target":
        return dataset
    rep = relabel(target, dataset.path, progress=progress)
    say(f"relabel: {rep.summary()}")
    return PreparedDataset.open(dataset.path, labels=True)


def _prepared(cfg: TrainConfig, target: Target, run_dir: Path, progress: bool):
    """Regenerate (optionally) and tokenize the training conversations; reuse cached stages."""
    from dflash_train.data.dataset import PreparedDataset, prepare_dataset
    from dflash_train.data.regenerate import RegenConfig, sample_ids
    from dflash_train.data.sources import SourceReport, default_split, iter_conversations

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
                 *([cfg.regen_server, cfg.regen_model] if cfg.regen_server else []))  # old cache keys unchanged
    data_dir = run_dir / f"data-{_key(src_key, cfg.regenerate, *regen_key, cfg.max_length)}"
    if (data_dir / "meta.json").is_file():
        say(f"using the prepared data in {data_dir}")
        return PreparedDataset.open(data_dir)
    report = SourceReport()
    convs = _select(iter_conversations(cfg.data, split=split, on_bad=cfg.on_bad, report=report,
                                       require_assistant=not cfg.regenerate), target, cfg, report)
    say(f"data: {report.summary()}")
    if cfg.regenerate:
        regen_path = run_dir / f"regenerated-{_key(src_key, *regen_key)}.jsonl"
        regen_cfg = RegenConfig(max_new_tokens=cfg.regen_max_new_tokens, temperature=cfg.regen_temperature,
                                batch_size=cfg.regen_batch_size, max_turns=cfg.regen_max_turns, seed=cfg.seed,
                                samples=cfg.regen_samples)
        rep = _regenerate(cfg, target, convs, regen_path, regen_cfg, progress)
        say(f"regenerate: {rep.summary()}")
        convs = _read_regenerated(regen_path, sample_ids([c.id for c in convs], cfg.regen_samples))
    prep = prepare_dataset(target.tokenizer, convs, data_dir, max_length=cfg.max_length, on_bad=cfg.on_bad,
                           target_spec=target.spec, source_summary=report.summary, overwrite=True)
    say(f"prepare: {prep.summary()}")
    return PreparedDataset.open(data_dir)


def _regenerate(cfg: TrainConfig, target: Target, convs: list, path: Path, regen_cfg, progress: bool):
    """The target writes the replies: in this process, or through --regen-server."""
    from dflash_train.data.regen_client import regenerate_via_server
    from dflash_train.data.regenerate import regenerate

    if not cfg.regen_server:
        say(f"regenerating {len(convs)} conversations with the target into {path}")
        return regenerate(target, convs, path, regen_cfg, progress=progress)
    server = cfg.server_config()
    say(f"regenerating {len(convs)} conversations through {server.url} into {path}")
    return regenerate_via_server(convs, path, regen_cfg, server, tokenizer=target.tokenizer, tokenizer_name=target.spec,
                                 progress=progress)


# A first prompt "about code": a fence, a keyword of code or a language name.
CODE_TOPIC = re.compile(r"```|\bdef |\bpython\b|\bfunction\b|\bcode\b|\bjavascript\b|\bclass\b|\bimport\b|"
                        r"\bsql\b|\bscript\b|\bjava\b|\bc\+\+|\btypescript\b|\bregex\b", re.IGNORECASE)


def _select(convs, target: Target, cfg: TrainConfig, report) -> list:
    """The first --num-conversations conversations whose first prompt fits --regen-max-prompt-tokens.

    Long prompts cost prefill time and leave no room for the reply within --max-length; they are
    skipped and counted. Sorted by prompt length so regeneration batches carry little padding.
    """
    from dflash_train.data.conversations import first_prompt

    picked: list[tuple[int, object]] = []
    for conv in convs:
        if cfg.data_topic == "code" and not CODE_TOPIC.search(first_prompt(conv.messages)[-1]["content"]):
            report.drop("not about code (--data-topic code)")
            continue
        n = len(target.render_chat(first_prompt(conv.messages))) if cfg.regenerate else 0
        if n > cfg.regen_max_prompt_tokens:
            report.drop("prompt longer than --regen-max-prompt-tokens")
            continue
        picked.append((n, conv))
        if cfg.num_conversations and len(picked) >= cfg.num_conversations:
            break
    picked.sort(key=lambda item: item[0])
    return [conv for _, conv in picked]


def _read_regenerated(path: Path, ids: list[str]):
    from dflash_train.data.sources import Conversation

    wanted = set(ids)
    by_id = {}
    # split on "\n" only: str.splitlines() also splits on U+2028 / U+0085, which replies contain raw
    # (the file is written with ensure_ascii=False); seen on the H200 with all of ShareGPT
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line:
            continue
        rec = json.loads(line)
        if rec["id"] in wanted:
            by_id[rec["id"]] = Conversation(rec["id"], rec["messages"])
    return [by_id[i] for i in ids if i in by_id]


def drafter_config(cfg: TrainConfig, target: Target):
    return drafter_config_for(target, num_layers=cfg.num_layers, block_size=cfg.block_size,
                              num_features=cfg.num_features, dtype=cfg.export_dtype,
                              num_sliding_layers=cfg.sliding_layers, sliding_window=cfg.sliding_window)


def check_mask_token_absent(dataset, mask_token_id: int, target: Target) -> None:
    """The mask token marks the slots to guess; in the data it would be a token the drafter must also read."""
    hits = dataset.count_token(mask_token_id)
    if hits:
        text = target.token_text(mask_token_id)
        name = f" ({text!r})" if text is not None else ""
        raise UsageError(f"{dataset.path}: the drafter's mask token {mask_token_id}{name} occurs {hits} times in "
                         "the training data; pick another (`dflash-train init-drafter --mask-token-id ID`, then "
                         "`train --init-drafter DIR`) or clean it out of the data")


def make_drafter(cfg: TrainConfig, target: Target, resume_ckpt: Path | None) -> DFlashDrafter:
    if resume_ckpt is not None:
        drafter = load_drafter(resume_ckpt / "drafter", dtype=torch.float32)
    elif cfg.init_drafter:
        drafter = load_drafter(cfg.init_drafter, dtype=torch.float32, flag="--init-drafter")
    else:
        drafter = new_drafter(drafter_config(cfg, target), cfg.seed, target.device)
        if cfg.init_from_target:
            init_from_target(drafter, target)
    check_compatible(drafter, target)
    return drafter.to(device=target.device, dtype=torch.float32)  # fp32 master weights


def eval_tau(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], cfg: TrainConfig, name: str,
             run_dir: Path, progress: bool, baseline: bool = True) -> EvalReport:
    """tau on the eval prompts; `baseline` adds target-only decoding (speedup + lossless check)."""
    drafter.eval()
    rep = evaluate(target, drafter, prompts, EvalConfig(max_new_tokens=cfg.eval_max_new_tokens, seed=cfg.seed,
                                                        baseline=baseline), progress=progress)
    rep.to_json(run_dir / f"eval_{name}.json")
    return rep


def run(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> int:
    roles = _roles(cfg)
    if roles and under_torchrun():
        return run_torchrun_worker(cfg, roles, resume, progress)
    with run_dir_lock(Path(cfg.run_dir)):
        return _run(cfg, roles, resume, overwrite, progress)


@contextmanager
def run_dir_lock(run_dir: Path):
    """One train job per run directory: a second one would interleave metrics.jsonl and overwrite
    the first one's checkpoints and drafter. Held for the whole job; the OS drops it when we exit."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(run_dir)
        holder = lock.acquire()
    except OSError as e:
        raise UsageError(f"--run-dir {run_dir}: cannot create or lock it ({e.strerror or e})") from None
    if holder is not None:
        pid = f" (pid {holder})" if holder else ""
        raise UsageError(f"--run-dir {run_dir} is in use by another train run{pid}; "
                         "wait for it to end or choose another --run-dir")
    try:
        yield
    finally:
        lock.release()


CPU_SPEEDUP_NOTE = (
    "note: on a CPU the speedup above says little about the drafter. The target's forward over a block "
    "of B tokens costs several one-token forwards there (its matmuls are compute-bound; on a GPU a "
    "small block costs about one step), so a DFlash step costs more than it saves unless tau is high: "
    "read tau. The one-GPU recipe: dflash-train train --config configs/smollm2-h200.toml (docs/quality.md).")


def _run(cfg: TrainConfig, roles, resume: bool, overwrite: bool, progress: bool) -> int:
    t0 = time.perf_counter()
    run_dir, ckpt = prepare_run_dir(cfg, resume, overwrite)
    state = load_state(ckpt) if ckpt else None  # a corrupt state fails before the target loads
    device = resolve_device(roles[0][1]) if roles else resolve_device(cfg.device)
    for d in [resolve_device(d) for role, d in roles if role != "target"] if roles else [device]:
        check_backend_device(cfg.attention, d)  # before any data is regenerated
    if cfg.init_drafter and not resume:
        load_config(cfg.init_drafter, "--init-drafter")  # a bad one fails now, not after the data work
    target = load_target(cfg.target, device=device)
    say(f"target {cfg.target}: {target.num_layers} layers, hidden {target.hidden_size}, on {device}")
    prompts = ([target.render_chat(m) for m in load_prompts(cfg.eval_dataset, cfg.eval_limit)]
               if cfg.eval_limit else [])
    dataset = build_dataset(cfg, target, run_dir, progress)
    drafter = make_drafter(cfg, target, ckpt)
    check_mask_token_absent(dataset, drafter.mask_token_id, target)
    n_params = sum(p.numel() for p in drafter.parameters())
    say(f"drafter: {n_params / 1e6:.2f}M parameters, {drafter.config.num_hidden_layers} layers, "
        f"B={drafter.block_size}, target layers {drafter.config.target_layer_ids}")
    before = None
    if prompts and ckpt is None:
        # tau only: the untrained drafter's speedup and losslessness are not the question here
        before = eval_tau(target, drafter, prompts, cfg, "before", run_dir, progress, baseline=False)
        say(f"untrained drafter: tau {before.tau:.3f} on {len(prompts)} {cfg.eval_dataset} prompts")
    if roles:
        init_dir = ckpt / "drafter" if ckpt else save_drafter(drafter, run_dir / "init_drafter", torch.float32)
        del target, drafter  # the workers load their own; free this process's device memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        code, steps, seconds = _train_processes(cfg, roles, init_dir, dataset, run_dir, ckpt, state, progress)
        if code:
            return code
        target = load_target(cfg.target, device=device)  # released while the workers ran
        drafter = load_drafter(latest_checkpoint(run_dir) / "drafter", device=device, dtype=torch.float32)
    else:
        steps, seconds = _train_here(cfg, target, drafter, dataset, run_dir, state, progress)
    export = export_drafter(drafter, run_dir, cfg)
    if prompts:
        after = eval_tau(target, load_drafter(export, device=device, dtype=target.dtype), prompts, cfg, "after",
                         run_dir, progress)
        print(after.summary())
        if device.type == "cpu":
            print(CPU_SPEEDUP_NOTE)
        print(f"tau on {len(prompts)} held-out {cfg.eval_dataset} prompts: "
              f"untrained {before.tau:.3f} -> trained {after.tau:.3f}" if before else
              f"tau of the trained drafter on {len(prompts)} held-out {cfg.eval_dataset} prompts: {after.tau:.3f}")
    print(f"trained {steps} steps in {seconds:.0f} s (run {time.perf_counter() - t0:.0f} s); "
          f"drafter exported to {export}")
    return 0


def export_drafter(drafter: DFlashDrafter, run_dir: Path, cfg: TrainConfig) -> Path:
    """RUN_DIR/drafter in --export-dtype (save_drafter refuses non-finite weights)."""
    return save_drafter(drafter, run_dir / "drafter", parse_dtype(cfg.export_dtype, "--export-dtype"))


def _roles(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(role, device) per worker process, or [] for the one-device path."""
    if cfg.target_devices is None:
        return []
    from dflash_train.pipeline.launcher import parse_devices

    targets = parse_devices(cfg.target_devices, "--target-devices")
    drafters = parse_devices(cfg.drafter_devices, "--drafter-devices")
    if targets == drafters:  # every device runs a whole pipeline; the drafters are data parallel
        roles = [("both", d) for d in targets]
    else:
        roles = [("target", d) for d in targets] + [("drafter", d) for d in drafters]
    cuda = [d for _, d in roles if d.startswith("cuda")]
    if len(set(cuda)) < len(cuda):
        raise UsageError("--target-devices/--drafter-devices: a CUDA device can hold one worker process (NCCL); "
                         "to put a target and a drafter on every GPU give both flags the same list, in the same order")
    if len({torch.device(d).type for _, d in roles}) > 1:
        raise UsageError("--target-devices and --drafter-devices must all be CUDA devices or all cpu "
                         "(features travel over NCCL or gloo)")
    return roles


def _train_here(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, dataset, run_dir: Path, state,
                progress: bool) -> tuple[int, float]:
    """One device, one process; SIGTERM stops like Ctrl-C: after a checkpoint."""
    import signal

    from dflash_train.pipeline.drafter_loop import GracefulStop
    from dflash_train.pipeline.local import train_local
    from dflash_train.profiling.session import profile_session

    def on_term(signum, frame):
        raise GracefulStop()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with profile_session(cfg, run_dir, f"main/{target.device}") as session:
            result = train_local(cfg, target, drafter, dataset, run_dir, state, progress, session.stats,
                                 trace=session.trace)
    except GracefulStop:
        say("SIGTERM: stopped after writing a checkpoint")
        raise SystemExit(143) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    return result.steps, result.seconds


def _train_processes(cfg: TrainConfig, roles, init_dir: Path, dataset, run_dir: Path, ckpt: Path | None, state,
                     progress: bool) -> tuple[int, int, float]:
    from dflash_train.pipeline.local import total_steps

    n_drafters = sum(1 for role, _ in roles if role != "target")
    steps = total_steps(cfg, dataset, n_drafters * cfg.grad_accum, state)
    start = state["step"] if state else 0
    say(f"training {steps - start} steps through {len(roles)} processes: "
        + ", ".join(f"{role} {dev}" for role, dev in roles))
    t0 = time.perf_counter()
    code = launch_workers(cfg, roles, run_dir, dataset.path, str(init_dir), ckpt, state, steps, progress)
    return code, steps, time.perf_counter() - t0


def launch_workers(cfg: TrainConfig, roles, run_dir: Path, data_dir, drafter_dir: str | None, ckpt: Path | None,
                   state, steps: int, progress: bool, checkpoints: bool = True) -> int:
    """One process per (role, device) on this host, started and watched by the Launcher; its exit code."""
    from dflash_train.pipeline.launcher import Launcher, free_port
    from dflash_train.pipeline.worker import WorkerSpec

    port = cfg.dist_port or free_port()
    specs = [WorkerSpec(rank=r, role=role, device=dev, devices=roles, cfg=cfg, run_dir=str(run_dir),
                        data_dir=str(data_dir), drafter_dir=drafter_dir, resume_state_path=str(ckpt) if ckpt else None,
                        stream=_stream_state(state), total_steps=steps, init_method=f"tcp://127.0.0.1:{port}",
                        progress=progress, checkpoints=checkpoints) for r, (role, dev) in enumerate(roles)]
    return Launcher(specs).run(cfg.peer_timeout)


def _stream_state(state):
    from dflash_train.pipeline.stream import StreamState

    return StreamState(**state["stream"]) if state else StreamState()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_torchrun_worker(cfg: TrainConfig, roles, resume: bool, progress: bool) -> NoReturn:
    """One rank of a torchrun launch: the role split of --target/--drafter-devices, repeated per node.

    torchrun starts the processes on every node and ends them all when one fails; this rank
    takes (role, device) = roles[LOCAL_RANK]. The data must be prepared beforehand (a prepared
    dataset directory in --data) and the run directory shared by the nodes.
    """
    from dflash_train.pipeline.local import total_steps
    from dflash_train.pipeline.worker import WorkerSpec, run_worker

    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", len(roles)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if local_world != len(roles):
        raise UsageError(f"torchrun --nproc-per-node must be {len(roles)} (one process per device of "
                         f"--target-devices and --drafter-devices), got {local_world}")
    from dflash_train.data.dataset import PreparedDataset

    if not (Path(cfg.data) / "meta.json").is_file():
        raise UsageError(f"--data {cfg.data}: under torchrun give a prepared dataset directory "
                         "(dflash-train prepare / regenerate first)")
    dataset = PreparedDataset.open(cfg.data, labels=cfg.labels == "target")
    run_dir = Path(cfg.run_dir)
    devices = roles * (world // local_world)
    # The first drafter rank writes metrics, checkpoints and the drafter: it holds the run directory's lock.
    writer = rank == next(r for r, (role, _) in enumerate(devices) if role != "target")
    with run_dir_lock(run_dir) if writer else nullcontext():
        ckpt = latest_checkpoint(run_dir) if resume else None
        state = load_state(ckpt) if ckpt else None
        n_drafters = sum(1 for role, _ in devices if role != "target")
        spec = WorkerSpec(rank=rank, role=roles[local_rank][0], device=roles[local_rank][1], devices=devices, cfg=cfg,
                          run_dir=str(run_dir), data_dir=str(dataset.path),
                          drafter_dir=str(ckpt / "drafter") if ckpt else cfg.init_drafter,
                          resume_state_path=str(ckpt) if ckpt else None, stream=_stream_state(state),
                          total_steps=total_steps(cfg, dataset, n_drafters * cfg.grad_accum, state),
                          init_method="env://", progress=progress)
        if writer:
            (run_dir / "config.toml").write_text(cfg.to_toml())
        n = len(devices)
        drafter = run_worker(spec, [0.0] * n, [0] * n, _NoStop())
        if drafter is not None and writer:
            export = export_drafter(drafter, run_dir, cfg)
            print(f"drafter exported to {export}; measure it with `dflash-train eval --drafter {export}`")
    # Leave without interpreter teardown, as the launcher's workers do (pipeline/worker.py): with
    # the process group's threads still alive at exit, a gloo rank aborted in std::terminate in
    # about 1 of 4 CPU runs after the work had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _NoStop:
    """Under torchrun there is no launcher to coordinate a graceful stop; checkpoints are periodic."""

    value = -1
