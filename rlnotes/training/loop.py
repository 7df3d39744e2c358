"""The train loop: resume from a checkpoint or start, the algorithm's train_step until
trainer.steps optimizer steps, evaluations, checkpoints, and what a stop or an error leaves
behind; then the final policy. The first sft_warmup.steps steps are supervised (training.warmup).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.markup import escape

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.errors import SaveFailed
from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.run import checkpoint, config_file, files, restore, rundir, signals, steplogs
from rlnotes.run.logger import RunConsole, passed_multiple
from rlnotes.training.context import Context
from rlnotes.training.evaluation import eval_metrics
from rlnotes.training.optimizer import apply_settings, changed_settings
from rlnotes.training.setup import open_logger, setup
from rlnotes.training.warmup import warming_up, warmup_step


def eval_due(previous: int, step: int, every: Optional[int], total: int) -> bool:
    """trainer.eval_every: after a step that passed a multiple of N (PPO's steps jump several at a
    time) and after the last; the train loop also evaluates before the first step."""
    return bool(every) and (passed_multiple(previous, step, every) or step == total)


def held_out(ctx: Context, algo: Algorithm) -> Dict[str, float]:
    """The algorithm's own held-out metrics, if it has an evaluation of its own, and those of
    generated completions when the run's evaluations generate (an algorithm that samples: always;
    another: eval.generate), timed as time/eval_s."""
    start = time.perf_counter()
    with ctx.model.autocast():
        metrics = algo.evaluate(ctx) if algo.evaluate is not None else {}
        if ctx.data.scorer is not None:
            metrics.update(eval_metrics(ctx.cfg, ctx.model.policy, ctx.data, ctx.run, ctx.out.run_dir))
    return {"time/eval_s": time.perf_counter() - start, **metrics}


def train(cfg, algo: Algorithm, run_dir: Path, console: Console) -> Dict[str, float]:
    """`_train` as the owner of `run_dir` (start_point takes its lock on rank 0; see rundir.own),
    which it gives up when the run ends, however it ends. A full disk is one line (SaveFailed)
    wherever the run was writing: a row of metrics.jsonl, samples, an evaluation, config.yaml."""
    try:
        return _train(cfg, algo, run_dir, console)
    except OSError as e:
        if not files.is_full(e):
            raise
        raise SaveFailed(disk_full(run_dir, f"writing the run's files in {run_dir}")) from None
    finally:
        rundir.release(run_dir)


def _train(cfg, algo: Algorithm, run_dir: Path, console: Console) -> Dict[str, float]:
    """Run the algorithm's train_step until `trainer.steps` optimizer steps; save the policy.

    A checkpoint every trainer.save_every steps and at the end; trainer.resume starts from one.
    Ctrl-C or SIGTERM saves a checkpoint of the last completed step, then raises
    config.Interrupted (a KeyboardInterrupt; see signals.StopSignals).
    """
    resume_from = start_point(cfg, run_dir, console)
    ctx = setup(cfg, algo, run_dir, console, resume_from)
    run, log = ctx.run, ctx.out
    if resume_from is not None:
        restore.check_data(resume_from, ctx.data.sampler, ctx.data.rows_sha256)  # before the run dir changes
    open_run(ctx, algo, resume_from)
    if resume_from is not None:
        resume(ctx, resume_from)
    log.logger.begin(run.step)  # the progress bar, speed and schedules start here
    boundary = capture(ctx)  # the state a stop goes back to: the end of the last logged step
    stop = signals.StopSignals(run, console)
    last: Dict[str, float] = {}
    with stop, contextlib.closing(ctx.model):  # the reference's process, if one started, ends with the loop
        try:
            if run.step == 0 and cfg.trainer.eval_every and cfg.trainer.eval_at_start:
                log.logger.log(0, held_out(ctx, algo))  # the starting point of every eval curve
            while run.step < cfg.trainer.steps:
                run.timers = {}
                start = time.perf_counter()
                with ctx.model.autocast():
                    metrics = warmup_step(ctx) if warming_up(run, cfg.sft_warmup) else algo.train_step(ctx)
                metrics.update(run.timers, **{"time/step_s": time.perf_counter() - start})
                # Ranks wait for the slowest; their tokens add up (all else is already the batch's).
                metrics = distributed.reduce_metrics(metrics, {**{k: "max" for k in metrics if k.startswith("time/")},
                                                               "perf/tokens": "sum"})
                metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / metrics["time/step_s"]
                if eval_due(boundary.step, run.step, cfg.trainer.eval_every, cfg.trainer.steps):
                    metrics.update(held_out(ctx, algo))  # after time/step_s: the step's time excludes it
                log.logger.observe(run.step, metrics, run.samples)  # progress, warnings, samples table
                if (run.step % cfg.trainer.log_every == 0 or run.step >= cfg.trainer.steps
                        or any(key.startswith("eval/") for key in metrics)):
                    log.logger.log(run.step, metrics)
                last = metrics
                previous, boundary, run.updating = boundary.step, capture(ctx), False
                if passed_multiple(previous, run.step, cfg.trainer.save_every):
                    with stop.saving(f"the checkpoint of step {run.step}"):
                        save_checkpoint(ctx, boundary)
                stop.check()
            with stop.saving(f"the checkpoint of step {run.step}"):
                save_checkpoint(ctx, boundary)
        except KeyboardInterrupt:
            stopped(ctx, boundary, stop)
            raise
        except Exception as error:
            rescue(ctx, boundary, error)
            raise
        except BaseException:
            log.logger.close()
            raise
    out = finish(ctx)
    log.logger.summary(out)
    return last


def start_point(cfg, run_dir: Path, console: Console) -> Optional[Path]:
    """The checkpoint trainer.resume names; None to start fresh. Runs before any model loads, so a
    bad path fails at once, and changes nothing in the run dir but its lock (and a damaged
    checkpoint set aside). Rank 0 decides; every rank resumes from the checkpoint it names."""
    return distributed.broadcast(_start_point(cfg, run_dir, console) if distributed.is_main() else None)


def _start_point(cfg, run_dir: Path, console: Console) -> Optional[Path]:
    rundir.check_run_dir(run_dir, cfg.trainer.resume, cfg.trainer.steps)  # before the lock file is made in it
    rundir.own(run_dir)  # the only process in this dir until train ends (the CLI may have taken it already)
    rundir.check_run_dir(run_dir, cfg.trainer.resume, cfg.trainer.steps)  # again, now that no one else writes it
    notes: List[str] = []
    path = restore.locate(cfg.trainer.resume, run_dir, notes)
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]", highlight=False)
    if path is None:
        return None
    step = checkpoint.read_manifest(path)["step"]
    rundir.check_steps(step, path, cfg.trainer.steps)
    changed = restore.check_config(path, cfg)
    if changed:
        console.print(f"[yellow]settings differ from the checkpoint's run:[/] {escape('; '.join(changed))}",
                      highlight=False)
    return path


def open_run(ctx: Context, algo: Algorithm, resume_from: Optional[Path]) -> None:
    """Once the model and data are loaded and the checkpoint fits them: the run's step logs cut back to
    the checkpoint's step (or emptied for a fresh start of resume=auto), its later checkpoints dropped,
    its config.yaml written and its metrics log opened. Rank 0 writes; the other ranks log nothing."""
    if not distributed.is_main():
        return
    cfg, run_dir, console = ctx.cfg, ctx.out.run_dir, ctx.out.console
    notes: List[str] = []
    if resume_from is None and cfg.trainer.resume == "auto":
        console.print(f"trainer.resume=auto: no checkpoint in {escape(str(run_dir / checkpoint.CHECKPOINTS))}; "
                      "starting at step 0 (to resume a run, pass its dir: hydra.run.dir=RUN_DIR)", highlight=False)
        notes += steplogs.carry_logs(None, run_dir, -1)  # rows of an attempt that saved nothing
    if resume_from is not None:
        step = checkpoint.read_manifest(resume_from)["step"]
        notes += steplogs.carry_logs(resume_from.parent.parent, run_dir, step)
        dropped = restore.drop_later(run_dir, step)
        changed = changed_settings(resume_from, cfg.optim)  # applied by `resume`
        console.print(f"resuming from {escape(str(resume_from))} at step {step}"
                      + (f"; {', '.join(changed)} from step {step}" if changed else "")
                      + (f"; later checkpoints dropped: {', '.join(p.name for p in dropped)}" if dropped else ""),
                      highlight=False)
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]", highlight=False)
    if isinstance(console, RunConsole):
        console.open_log(run_dir)  # the run owns its dir: what the console said and says goes to train.log
    config_file.write(run_dir / "config.yaml", cfg)
    ctx.out.logger = open_logger(cfg, algo, run_dir, console)


def resume(ctx: Context, path: Path) -> None:
    """Load a checkpoint into a context set up from it (setup loaded the policy's weights): heads
    first (they join the optimizer), then optimizer, scheduler, RNG, data position and the algorithm's
    state; optimizer settings this run changes (optim.lr, ...) then apply from the checkpoint's step."""
    manifest = checkpoint.read_manifest(path)
    for name, head in restore.load_heads(path, manifest, ctx.model.device).items():
        ctx.model.add_head(name, head, ctx.run.step)
    restore.load(ctx, path, manifest)
    if changed_settings(path, ctx.cfg.optim):
        apply_settings(ctx.model, ctx.cfg.optim)


def capture(ctx: Context) -> checkpoint.Boundary:
    """The state a stop goes back to, now: the end of the last completed step."""
    return checkpoint.capture(ctx.run, ctx.data.sampler, ctx.model.device)


def finish(ctx: Context, interrupted: bool = False) -> Path:
    """Save the policy (adapter or full model) and close the log; rank 0 writes (every rank must
    call this: FSDP gathers the weights first)."""
    ctx.out.logger.close()
    if ctx.rollouts.engine is not None:
        ctx.rollouts.engine.close()
    out = ctx.out.run_dir / ("interrupted" if interrupted else "final")
    state = fsdp.full_state(ctx.model.policy.model)
    if distributed.is_main():
        checkpoint.save_whole(ctx.model.policy, ctx.model.heads, out, state)  # a dir called final/ is a finished run's
    return out


def save_checkpoint(ctx: Context, boundary: checkpoint.Boundary) -> Optional[Path]:
    """checkpoint.save on rank 0, which holds the state of every rank (under FSDP gathered from
    them first: every rank must call this); None on the others. A full disk is one line: the
    failed save left nothing behind and the previous checkpoints are kept."""
    shards = checkpoint.Shards(fsdp.full_state(ctx.model.policy.model),
                               distributed.optimizer_shards(ctx.model.optimizer), distributed.world_size())
    if not distributed.is_main():
        return None
    try:
        return checkpoint.save(ctx, boundary, ctx.cfg.trainer.keep_last, shards)
    except OSError as e:
        if not files.is_full(e):
            raise
        target = checkpoint.checkpoint_dir(ctx.out.run_dir, boundary.step)
        raise SaveFailed(disk_full(ctx.out.run_dir, f"saving checkpoint {target.name} to {target.parent}")) from None


def disk_full(run_dir: Path, doing: str) -> str:
    """The line for a run stopped by a full disk while `doing` something: the checkpoints kept
    and the command that resumes once there is space."""
    kept = checkpoint.checkpoints(run_dir)
    return (f"no space left on device while {doing}; "
            + (f"the previous checkpoints are kept (the latest: {kept[-1].name})" if kept else
               "there is no earlier checkpoint") + ": free space and resume with: " + signals.resume_command(run_dir))


def _latest_checkpoint(run_dir: Path) -> str:
    found = checkpoint.checkpoints(run_dir)
    return f"the latest checkpoint is {escape(str(found[-1]))}" if found else "there is no checkpoint yet"


def stopped(ctx: Context, boundary: checkpoint.Boundary, stop: signals.StopSignals) -> None:
    """After Ctrl-C or SIGTERM: a checkpoint of the last completed step; stopped in the middle of a
    step's updates (a second signal), the policy as it is goes to interrupted/ instead. A save the
    user abandoned (see signals.StopSignals) is not tried again. The caller says how to resume."""
    say = lambda text: ctx.out.console.print(f"[yellow]{text}[/]", soft_wrap=True, highlight=False)  # noqa: E731
    if ctx.run.updating:
        with stop.saving(f"the policy of step {boundary.step + 1}, stopped in its updates, to interrupted/"):
            out = finish(ctx, interrupted=True)
        say(f"{stop.name} during the updates of the step after {boundary.step}: that policy is in "
            f"{escape(str(out))}, but cannot be resumed; {_latest_checkpoint(ctx.out.run_dir)}")
        return
    ctx.out.logger.close()
    if boundary.step == 0:
        say(f"{stop.name} before the first step; nothing saved")
        return
    if not stop.abandoned:
        target = checkpoint.checkpoint_dir(ctx.out.run_dir, boundary.step)
        try:
            with stop.saving(f"the checkpoint of step {boundary.step} to {target}"):
                path = save_checkpoint(ctx, boundary)
            if path is not None:
                say(f"{stop.name} at step {boundary.step}: checkpoint saved to {escape(str(path))}")
            return
        except KeyboardInterrupt:  # the user abandoned it
            pass
    say(f"{stop.name}: the checkpoint of step {boundary.step} was abandoned; {_latest_checkpoint(ctx.out.run_dir)}")


def rescue(ctx: Context, boundary: checkpoint.Boundary, error: Exception) -> None:
    """After an error that stops the run (a reward function failing on every sample, non-finite
    losses, a bug): the checkpoint of the last completed step, so that the steps done are not lost,
    when no update has moved the weights since it (else the last saved checkpoint stands). With
    several processes only the failing rank knows, and a save needs them all: nothing is saved."""
    ctx.out.logger.close()
    if ctx.run.updating or boundary.step == 0 or distributed.active() or isinstance(error, SaveFailed):
        return
    try:
        path = save_checkpoint(ctx, boundary)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return
    ctx.out.console.print(f"[yellow]stopped by the error below after step {boundary.step}: the checkpoint of that "
                          f"step is in {path}[/]", soft_wrap=True, highlight=False)
