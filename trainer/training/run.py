"""The life of a torchrun-launched training run, the same for the retrieval trainer (trainer.main)
and the captioner's (trainer.caption.train): its arguments, the process group, the run folder's
lock, the checkpoint to resume, the MLflow run, rank 0's registration of `best/`, the JSON
summary and the exit status (0; 1 on an error; a stop's, trainer/training/preemption.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from defrag.cli import add_debug_flag, one_line_errors
from defrag.urls import redact
from trainer.config import Config
from trainer.store.registry import RegistrationFailed, register_from_run
from trainer.store.tracking import Tracker
from trainer.training.checkpoint import (
    TrainState,
    clear_partial,
    latest_checkpoint,
    load_state,
    resume_changes,
    verify_checkpoint,
)
from trainer.training.distributed import (
    DistContext,
    end_process,
    init_distributed,
    peers_named,
)
from trainer.training.preemption import Preempted, stop_on_sigterm
from trainer.training.run_lock import run_dir_locked

log = logging.getLogger("trainer")

TrainFn = Callable[[Config, DistContext, str], dict]  # (config, process group, --resume): summary


def main_of(train_fn: TrainFn, prog: str, doc: str) -> Callable[[list[str] | None], None]:
    """The entry point of a torchrun-launched training (`train_fn`): arguments, logging, one
    error line, and the process's exit code (trainer.main, trainer.caption.train)."""

    def main(argv: list[str] | None = None) -> None:
        args = parse_args(argv, prog, doc)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        code = 1  # unless the training ends or is preempted
        try:
            with one_line_errors(prog, args.debug):
                code = run(args.config, args.overrides, args.resume, train_fn)
        except SystemExit as failed:  # one_line_errors' line (end_process exits before Python
            print(failed.code, file=sys.stderr)  # would print it)
        except Exception:  # with --debug
            log.exception("training failed")
        finally:
            end_process(code)

    return main


def parse_args(argv: list[str] | None, prog: str, doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--config", help="YAML config file (trainer/config.py lists every key)")
    parser.add_argument("--resume", default="latest",
                        help="'latest' (default: the run's newest checkpoint, if any), "
                             "'none' (start over), or a checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.lr=0.01")
    add_debug_flag(parser)
    return parser.parse_intermixed_args(argv)  # overrides before and after the options


def run(config: str | None, overrides: list[str], resume: str, train_fn: TrainFn) -> int:
    """Load the config (a YAML file, then `section.key=value` overrides), join the process group,
    lock the run folder, train; the summary printed by rank 0. The exit status: 0, or a stop's
    (trainer/training/preemption.py says why). A collective that fails names the lost ranks."""
    cfg = Config.load(config, overrides)
    ctx = init_distributed(cfg.run.device, cfg.run.collective_timeout)
    try:
        with peers_named(ctx), stop_on_sigterm(), run_dir_locked(cfg.run.run_dir, ctx):
            summary = train_fn(cfg, ctx, resume)
    except Preempted as stop:  # a clean stop
        log.info("%s", stop)
        return stop.exit_code
    except RegistrationFailed as failed:  # trained, not registered: the summary, then exit 1
        print(json.dumps(redact(failed.summary)))
        raise
    if ctx.is_main:
        print(json.dumps(redact(summary)))
    return 0


def fit_and_register(cfg: Config, ctx: DistContext, resume: str,
                     start: Callable[[Tracker, TrainState], Any],
                     best: Callable[[TrainState], dict], experiment: str = "defrag") -> dict:
    """What every training run does around its trainer (`start(tracker, state)`, with `resume`
    and `fit`): the run folder, the checkpoint to resume, the MLflow run, and rank 0's
    registration of `best/`; the run's summary (`best` names its best figure). A failed
    registration raises RegistrationFailed carrying the summary, with the command that registers
    `best/` later."""
    run_dir = Path(cfg.run.run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        clear_partial(run_dir)
    checkpoint = find_checkpoint(resume, run_dir)
    state = load_state(checkpoint) if checkpoint else TrainState()
    # refused before the MLflow run is touched: a refused resume leaves it as it was
    changes = (", ".join(resume_changes(checkpoint, state, cfg, ctx.world_size)) if checkpoint
               else "")
    tracker = Tracker.start(cfg, run_dir, ctx.rank, experiment=experiment,
                            resume_run_id=state.mlflow_run_id)
    with tracker:  # any exception ends the run FAILED, the error as its tag
        if changes and ctx.is_main:
            log.info("resuming %s with a changed config: %s", checkpoint, changes)
            tracker.set_tag(f"resumed/{checkpoint.name}", changes)
        trainer = start(tracker, state)
        if checkpoint:
            trainer.resume(checkpoint)
        try:
            state = trainer.fit()
        except Preempted:
            tracker.finish("KILLED")  # the requeued job resumes it (RUNNING again)
            raise
        summary = {"best_epoch": state.best_epoch, **best(state), "run_dir": str(run_dir),
                   "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.tracking_uri}
        if ctx.is_main and state.best_epoch >= 0:
            summary.update(register_best(cfg, tracker, run_dir, state.best_epoch, summary))
    return summary


def register_best(cfg: Config, tracker: Tracker, run_dir: Path, best_epoch: int,
                  summary: dict) -> dict:
    """Register `best/` as run.register_name@run.register_alias: the summary's registration
    fields. A failure raises RegistrationFailed carrying `summary` with its error."""
    name, alias = cfg.run.register_name, cfg.run.register_alias
    try:  # under a path of its own: a run resumed for more epochs registers each new best
        version = register_from_run(tracker, run_dir / "best", name, alias,
                                    artifact_path=f"model-epoch-{best_epoch:03d}")
    except RegistrationFailed as failed:  # the run still ends FINISHED
        failed.summary = {**summary, "registered": None, "version": None,
                          "registration_error": failed.error, "register_later": failed.command}
        raise
    return {"registered": f"models:/{name}@{alias}", "version": version}


def find_checkpoint(resume: str, run_dir: Path) -> Path | None:
    """The verified checkpoint `--resume` names: none, the newest intact one, or a folder."""
    if resume == "none":
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    return verify_checkpoint(Path(resume), advice="resume another checkpoint (--resume latest "
                                                   "takes the newest intact one)")
