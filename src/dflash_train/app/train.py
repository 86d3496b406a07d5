"""`dflash-train train`: from conversations to an exported, evaluated drafter in one command.

    1. data     conversations (train split) -> target-regenerated replies -> tokenized dataset,
                each stage cached in the run directory under a key of its inputs' content (app/dataset.py)
    2. drafter  a fresh drafter shaped for the target (or --init-drafter, or the checkpoint on --resume)
    3. tau      of the drafter before training, when it starts trained (--eval-before)
    4. train    one device (app/local.py) or one process per device (app/ranks.py):
                checkpoints, metrics.jsonl, TensorBoard, profile summaries
    5. export   RUN_DIR/drafter/ in the reference format, and tau of the trained drafter
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import time
from pathlib import Path

import torch

from dflash_train.app import precompile
from dflash_train.app.dataset import build_dataset
from dflash_train.app.drafter import (
    check_fresh_drafter,
    check_mask_token_absent,
    drafter_side_target,
    make_drafter,
    planned_config,
)
from dflash_train.app.local import train_local
from dflash_train.app.phases import Phases
from dflash_train.app.placement import check_placement
from dflash_train.app.plan import RunPlan
from dflash_train.app.ranks import drafter_count, launch_workers, run_torchrun_rank, under_torchrun, worker_roles
from dflash_train.app.run_dir import export_drafter, prepare_run_dir, run_dir_lock
from dflash_train.app.validation import VALIDATION_FILE, Validation
from dflash_train.decode import greedy_loop, static_lm
from dflash_train.decode.limits import check_context, check_decode
from dflash_train.devices import resolve_device
from dflash_train.errors import say
from dflash_train.eval.evaluate import EvalReport, evaluate
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import render_chat
from dflash_train.models.checkpoint import load_config, load_drafter, save_drafter
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import Target
from dflash_train.objective.objective import (
    check_backend_device,
    check_backend_heads,
    check_compile_masks,
    resolve_backend,
)
from dflash_train.profiling.session import profile_session
from dflash_train.profiling.stall import StallWatch
from dflash_train.settings.tree import TrainConfig
from dflash_train.training.checkpoint import latest_checkpoint, load_state
from dflash_train.training.replay import replay_commits
from dflash_train.training.trainer import GracefulStop

PHASES_FILE = "phases.json"  # the last run's seconds per phase (app/phases.py)
CPU_SPEEDUP_NOTE = (
    "note: on a CPU the speedup above says little about the drafter. The target's forward over a block "
    "of B tokens costs several one-token forwards there (its matmuls are compute-bound; on a GPU a "
    "small block costs about one step), so a DFlash step costs more than it saves unless tau is high: "
    "read tau. The one-GPU recipe: dflash-train train --config configs/smollm2-h200.toml (docs/quality.md).")


def run(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> int:
    roles = worker_roles(cfg)
    if roles and under_torchrun():
        check_placement(cfg, roles)  # every rank, before it loads anything
        return run_torchrun_rank(cfg, roles, resume, progress)
    with run_dir_lock(Path(cfg.run.run_dir)):
        return _run(cfg, roles, resume, overwrite, progress)


def eval_tau(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], cfg: TrainConfig, name: str,
             run_dir: Path, progress: bool, baseline: bool = True) -> EvalReport:
    """tau on the eval prompts; `baseline` adds target-only decoding (speedup + lossless check)."""
    drafter.eval()
    settings = dataclasses.replace(cfg.evaluation(), baseline=baseline and cfg.eval.baseline)
    rep = evaluate(target, drafter, prompts, settings, progress=progress, replay=replay_commits)
    rep.to_json(run_dir / f"eval_{name}.json", "--run-dir")
    return rep


def evaluates_before(cfg: TrainConfig, ckpt: Path | None) -> bool:
    """Whether the job measures tau before training: never on resume (the drafter is part-trained),
    and by default only for a drafter that starts trained (--eval-before)."""
    if ckpt is not None or cfg.eval.before == "no":
        return False
    return cfg.eval.before == "yes" or cfg.drafter.init_drafter is not None


def job_target(cfg: TrainConfig, device: torch.device, ckpt: Path | None = None) -> Target:
    """The target this process holds, on `device`: whole, or for a target split by --target-tp only the parts
    the job uses (tokenizer, embedding and LM head, the drafter's start): its replicas hold the layers."""
    fresh = ckpt is None and not cfg.drafter.init_drafter
    if cfg.pipeline.target_tp > 1:
        say(f"--target-tp {cfg.pipeline.target_tp}: this process holds the target's embedding and LM head "
            f"{'and the layers the drafter starts as ' if fresh and cfg.drafter.init_from_target else ''}"
            "only; its replicas hold its layers, split over their devices")
    return drafter_side_target(cfg, device, fresh=fresh, where=device)


def _run(cfg: TrainConfig, roles, resume: bool, overwrite: bool, progress: bool) -> int:
    phases = Phases.of_job()
    run_dir, ckpt = prepare_run_dir(cfg, resume, overwrite)
    state = load_state(ckpt) if ckpt else None  # a corrupt state fails before the target loads
    device = resolve_device(roles[0][1]) if roles else resolve_device(cfg.run.device)
    drafter_devices = [resolve_device(d) for role, d in roles if role != "target"] if roles else [device]
    for d in drafter_devices:
        check_backend_device(cfg.objective.attention, d)  # before any data is regenerated
    if cfg.drafter.init_drafter and not resume:
        load_config(cfg.drafter.init_drafter, "--init-drafter")  # a bad one fails now, not after the data work
    check_placement(cfg, roles, device)  # before anything loads
    with phases.time("load target"):
        target = job_target(cfg, device, ckpt)
    say(f"target {cfg.run.target}: {target.num_layers} layers, hidden {target.hidden_size}, on {device}")
    if not (cfg.drafter.init_drafter or ckpt):  # a starting drafter or checkpoint fixes its shape itself
        check_fresh_drafter(cfg, target)  # before the data work
    planned = planned_config(cfg, target, ckpt)  # the drafter to be trained, before it is built
    check_backend_heads(cfg.objective.attention, planned.head_dim)
    for d in drafter_devices:
        backend = resolve_backend(cfg.objective.attention, d, planned.head_dim)
        check_compile_masks(cfg.trainer.compile_masks, cfg.objective.attention, backend)
    prompts = ([render_chat(target, m) for m in load_prompts(cfg.eval.dataset, cfg.eval.limit)]
               if cfg.eval.limit else [])
    if prompts:  # a too-long eval fails now, not after the data work and the training
        check_context(target, max(map(len, prompts)), cfg.eval.max_new_tokens, "--eval-max-new-tokens")
    # the drafter's training graphs compiled in a process of its own meanwhile (--precompile)
    ahead = precompile.start(cfg, lambda: planned, target)
    try:
        dataset = build_dataset(cfg, target, run_dir, progress, phases)
    except BaseException:
        precompile.stop(ahead)
        raise
    if ahead is not None:
        with phases.time("precompile wait"):  # 0 s where it ended before the data was ready
            precompile.finish(ahead)
    drafter = make_drafter(cfg, target, ckpt)
    plan = RunPlan.make(cfg, dataset, drafter.config, drafter_count(roles) * cfg.optimizer.grad_accum, state)
    check_mask_token_absent(dataset, drafter.mask_token_id, target)
    if prompts:  # the eval's KV caches must fit the device: known now, before the training
        check_decode(target, drafter, prompts, cfg.eval.max_new_tokens, flag="--eval-max-new-tokens")
    n_params = sum(p.numel() for p in drafter.parameters())
    say(f"drafter: {n_params / 1e6:.2f}M parameters, {drafter.config.num_hidden_layers} layers, "
        f"B={drafter.block_size}, target layers {drafter.config.target_layer_ids}")
    before = None
    if prompts and evaluates_before(cfg, ckpt):
        # tau only: the untrained drafter's speedup and losslessness are not the question here
        # in the dtype the trained drafter is evaluated in (the export, below): the same decode, and
        # cheaper than the fp32 master weights (6.4 ms a step on the H200 against 4.8 ms in bf16)
        with phases.time("eval before"):
            untrained = copy.deepcopy(drafter).to(target.dtype)
            before = eval_tau(target, untrained, prompts, cfg, "before", run_dir, progress, baseline=False)
            greedy_loop.release(untrained)  # with its caches and graphs: not held through training
        say(f"untrained drafter: tau {before.tau:.3f} on {len(prompts)} {cfg.eval.dataset} prompts")
    with phases.time("train"):
        if roles:
            init_dir = ckpt / "drafter" if ckpt else save_drafter(drafter, run_dir / "init_drafter", torch.float32,
                                                                  "--run-dir")
            try:
                # the workers' held-out packs
                validation = save_validation(cfg, target, plan, dataset, run_dir)
                static_lm.release(target.model)
                del target, drafter  # the workers load their own; free this process's device memory
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                code, steps, seconds = _train_processes(cfg, roles, init_dir, dataset.path, plan, run_dir, ckpt,
                                                        state, progress, validation)
            finally:  # ~0.7 GB for 200 conversations of SmolLM2: not kept (after a hard kill, the next run removes it)
                (run_dir / VALIDATION_FILE).unlink(missing_ok=True)
            if code:
                return code
            if prompts:  # released while the workers ran; the evaluation decodes with it
                target = job_target(cfg, device)
            drafter = load_drafter(latest_checkpoint(run_dir) / "drafter", device=device, dtype=torch.float32)
        else:
            steps, seconds = _train_here(cfg, target, drafter, dataset, run_dir, state, progress, plan)
    export = export_drafter(drafter, run_dir, cfg)
    if prompts:
        with phases.time("eval after"):
            after = eval_tau(target, load_drafter(export, device=device, dtype=target.dtype), prompts, cfg, "after",
                             run_dir, progress)
        print(after.summary())
        if device.type == "cpu":
            print(CPU_SPEEDUP_NOTE)
        print(f"tau on {len(prompts)} held-out {cfg.eval.dataset} prompts: "
              f"untrained {before.tau:.3f} -> trained {after.tau:.3f}" if before else
              f"tau of the trained drafter on {len(prompts)} held-out {cfg.eval.dataset} prompts: {after.tau:.3f}")
    phases.save(run_dir / PHASES_FILE)
    resumed = f", {steps - state['step']} of them in this run (resumed at {state['step']})" if state else ""
    print(f"trained {steps} steps{resumed} in {seconds:.0f} s; drafter exported to {export}")
    print(f"{phases.summary()} ({run_dir / PHASES_FILE})")
    return 0


def _train_here(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, dataset, run_dir: Path, state,
                progress: bool, plan: RunPlan) -> tuple[int, float]:
    """One device, one process; SIGTERM stops like Ctrl-C: after a checkpoint."""

    def on_term(signum, frame):
        raise GracefulStop()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with profile_session(cfg.profiling, run_dir, f"main/{target.device}", cfg.oom_hint()) as session, \
                StallWatch(run_dir / "stall-stacks.txt", cfg.pipeline.peer_timeout) as watch:
            result = train_local(cfg, target, drafter, dataset, run_dir, state, progress, session.stats,
                                 trace=session.trace, heartbeat=watch.beat, plan=plan)
    except GracefulStop:
        say("SIGTERM: stopped after writing a checkpoint")
        raise SystemExit(143) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    return result.steps, result.seconds


def save_validation(cfg: TrainConfig, target: Target, plan: RunPlan, dataset, run_dir: Path) -> Path | None:
    """The held-out packs and their target features, saved for the workers (app/validation.py); None without."""
    held_out = plan.held_out_data(dataset)
    if held_out is None or cfg.pipeline.target_tp > 1:  # split: the first target replica builds them
        return None
    path = run_dir / VALIDATION_FILE
    Validation.build(cfg, target, held_out, plan.features).save(path)  # the packs carry what training's do
    return path


def _train_processes(cfg: TrainConfig, roles, init_dir: Path, data_dir: Path, plan: RunPlan, run_dir: Path,
                     ckpt: Path | None, state, progress: bool, validation: Path | None) -> tuple[int, int, float]:
    steps = plan.total_steps
    start = state["step"] if state else 0
    say(f"training {steps - start} steps through {len(roles)} processes: "
        + ", ".join(f"{role} {dev}" for role, dev in roles))
    t0 = time.perf_counter()
    code = launch_workers(cfg, roles, run_dir, data_dir, str(init_dir), ckpt, plan, progress, validation=validation)
    return code, steps, time.perf_counter() - t0
