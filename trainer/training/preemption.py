"""Stop on request with a checkpoint: how a preempted, evicted or time-limited job ends cleanly.

A stop is requested two ways:
- the file `<run_dir>/PREEMPT`: launch/slurm/train.sbatch creates it when its batch shell gets
  SIGUSR1 shortly before the time limit (`--signal=B:USR1@120`), and `touch` does it by hand. A
  file because torchrun's agent does not forward SIGUSR1 to its workers (the signal kills it).
  Only rank 0 looks (ranks on other nodes may see a shared filesystem late);
- SIGTERM to any rank: what Kubernetes and `docker stop` send on eviction (to torchrun, whose
  agent sends it on to every worker), and `scancel --signal=TERM JOB` to every process of a
  job's steps. Inside `stop_on_sigterm` the signal only sets a flag. (At the time limit SLURM
  SIGTERMs srun too, which SIGKILLs its tasks at once: there the SIGUSR1 file path does it.)

The run_dir lock's heartbeat, on finding the lock another run's (trainer/training/run_lock.py), asks
for the opposite (`fail_after_step`): at the same check (each step's, and one after each epoch's
validation, before its writes) every rank raises RunDirLost, before any save, so the run writes no
checkpoint or PREEMPTED into a folder another run now holds and ends FAILED (exit status 1), even if
a stop was requested too.

Every step, and after each epoch's end-of-epoch checkpoint, every rank calls `stop_requested`:
one all-reduce of what each rank saw, so all ranks stop after the same step (a request during
the validation stops the run once it and that checkpoint are done, not earlier). They
checkpoint together (at an epoch's end: the end-of-epoch checkpoint), rank 0 replaces the
request with `<run_dir>/PREEMPTED` (the checkpoint's global step), and every rank raises
`Preempted`: `trainer.training.run` marks the MLflow run KILLED and exits without registering a
model.

The exit status. On the PREEMPT file: 0, because torchrun reports a failed worker as its own
exit status 1 (and restarts the workers under `--max-restarts`), so a code would never reach the
batch script. On SIGTERM: 143 (128 + SIGTERM, what the signal itself would give), so a bare
`python -m trainer.main` in a Kubernetes Job is retried rather than counted as complete. torchrun
itself, once SIGTERMed, waits for its workers (`--shutdown-timeout`, 30 s by default, then
SIGKILL), logs the signal with a SignalException traceback and exits 1 whatever they returned:
a step and its checkpoint, and a whole validation and the end-of-epoch checkpoint, must fit in
that time and in Kubernetes' terminationGracePeriodSeconds (30 s by default too), else the
ranks are SIGKILLed with no checkpoint and the MLflow run is left RUNNING. Either way
PREEMPTED, not the status, says the run stopped cleanly: the batch script requeues the job
when it finds it, and the next attempt resumes from the checkpoint (`--resume latest`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.training.distributed import DistContext

REQUEST = "PREEMPT"  # created by whoever wants the run to stop
DONE = "PREEMPTED"  # left by the run once it stopped with a checkpoint
SIGTERM = "SIGTERM"
SIGTERM_EXIT = 128 + signal.SIGTERM
_REASONS = {1: REQUEST, 2: SIGTERM}  # combined across ranks by their maximum
_sigterm = threading.Event()
_lost: list[str] = []  # why the run_dir is no longer this run's (fail_after_step)


class RunDirLost(RuntimeError):
    """The run_dir's lock became another run's: the run ends with an error, saving nothing."""


class Preempted(Exception):
    """Raised on every rank once the requested stop's checkpoint is complete; `exit_code` is
    the process's exit status."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM asks for a stop after the current step (`stop_requested`)
    instead of ending the process at once; a rank hung in a collective (a dead peer under NCCL)
    is then ended by torchrun's SIGKILL after `--shutdown-timeout`. Call it in the main thread."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _sigterm.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _sigterm.clear()
        _lost.clear()


def fail_after_step(why: str) -> None:
    """From any thread: every rank raises RunDirLost(`why`) at the next `stop_requested`, before
    any save (the run_dir lock's heartbeat, once another run has taken the lock)."""
    _lost.append(why)


def stop_requested(run_dir: str | Path, ctx: DistContext) -> str | None:
    """Collective, called by every rank at every step: why the run stops after this step (SIGTERM
    when any rank got it, else REQUEST when rank 0 sees the file), None to go on; the same on
    every rank. Raises RunDirLost on every rank instead when rank 0's run_dir lock was lost."""
    seen = (3 if _lost else 2 if _sigterm.is_set()
            else int(ctx.is_main and (Path(run_dir) / REQUEST).exists()))
    flag = torch.tensor([seen], dtype=torch.int32, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()) == 3:
        why = _lost[0] if _lost else f"run_dir {run_dir}: rank 0's lock file is another run's"
        raise RunDirLost(f"{why}; another run may be writing into the folder: this run stopped "
                         "without saving anything there; resume it (--resume latest) once that "
                         "run is done")
    return _REASONS.get(int(flag.item()))


def acknowledge(run_dir: str | Path, ctx: DistContext, step: int, reason: str) -> Preempted:
    """After the checkpoint of `step`: rank 0 replaces the request with PREEMPTED; every rank
    gets the exception to raise."""
    if ctx.is_main:
        (Path(run_dir) / DONE).write_text(f"{step}\n")
        (Path(run_dir) / REQUEST).unlink(missing_ok=True)
    what = "on SIGTERM" if reason == SIGTERM else f"on request ({REQUEST} file)"
    return Preempted(f"stopped {what} with a checkpoint at step {step}; run again (--resume "
                     "latest) to continue", SIGTERM_EXIT if reason == SIGTERM else 0)
