"""Stop on request with a checkpoint: how a preempted or time-limited job (SLURM) ends cleanly.

A stop is requested by creating the file `<run_dir>/PREEMPT`: launch/slurm/train.sbatch does it
when its batch shell gets SIGUSR1 shortly before the time limit, and `touch` does it by hand. A
file rather than a signal because torchrun's agent does not forward SIGUSR1 to its workers (the
signal kills the agent), and SIGTERM reaches every process at once with no time to agree on a
step. In multi-node runs `run_dir` is on a shared filesystem anyway (checkpoints, resume).

Every step, rank 0 looks for the file and broadcasts what it saw, so all ranks stop after the
same step. They checkpoint together, rank 0 replaces the request with `<run_dir>/PREEMPTED`
(the checkpoint's global step), and every rank raises `Preempted`: `trainer.main` then exits 0
without registering a model. Exit 0, not a special code, because torchrun reports any failed
worker as its own exit code 1 (and restarts the workers under `--max-restarts`), so a code
would never reach the batch script. The script requeues the job when it finds PREEMPTED, and
the requeued job resumes from the checkpoint (`--resume latest`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from trainer.distributed import DistContext

REQUEST = "PREEMPT"  # created by whoever wants the run to stop
DONE = "PREEMPTED"  # left by the run once it stopped with a checkpoint


class Preempted(Exception):
    """Raised on every rank once the requested stop's checkpoint is complete."""


def stop_requested(run_dir: str | Path, ctx: DistContext) -> bool:
    """Collective, called by every rank at every step: whether rank 0 sees the request file.

    Only rank 0 looks (ranks on other nodes may see a shared filesystem late); the broadcast of
    one integer makes the answer identical everywhere.
    """
    flag = torch.tensor([ctx.is_main and (Path(run_dir) / REQUEST).exists()], dtype=torch.int32,
                        device=ctx.device)
    if ctx.world_size > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def acknowledge(run_dir: str | Path, ctx: DistContext, step: int) -> Preempted:
    """After the checkpoint of `step`: rank 0 replaces the request with PREEMPTED; every rank
    gets the exception to raise."""
    if ctx.is_main:
        (Path(run_dir) / DONE).write_text(f"{step}\n")
        (Path(run_dir) / REQUEST).unlink(missing_ok=True)
    return Preempted(f"stopped on request ({REQUEST} file) with a checkpoint at step {step}; "
                     "run again (--resume latest) to continue")
