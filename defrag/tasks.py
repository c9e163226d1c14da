"""A job's work split across tasks of an existing engine: unit u of the work is task u % N's.
The task is this process's SLURM array task or torchrun rank, or the flags `--task I --tasks N`;
one task (the default) does the whole job. Each task writes its units' results; a separate step
merges them (`defrag index --merge`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """Task `index` of `count`."""

    index: int
    count: int

    def owns(self, unit: int) -> bool:
        return unit % self.count == self.index


WHOLE_JOB = Task(0, 1)


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", type=int, metavar="I",
                        help="do task I of --tasks N: unit u is task u %% N's (default: the "
                             "SLURM array task or torchrun rank, else the whole job)")
    parser.add_argument("--tasks", type=int, metavar="N",
                        help="tasks the job is split into (--tasks 1: the whole job here, "
                             "whatever the environment says)")


def task_from(task: int | None, tasks: int | None,
              environ: Mapping[str, str] = os.environ) -> Task:
    """This process's task: the flags', else the SLURM array task's (numbered from the array's
    first id, by its step), else the torchrun rank's, else the whole job. ValueError (one line)
    for flags or an array that name no task."""
    if tasks is not None or task is not None:
        if tasks is None:
            raise ValueError("--task needs --tasks N")
        if tasks < 1:
            raise ValueError(f"--tasks {tasks}: at least 1")
        if task is None and tasks > 1:
            raise ValueError(f"--tasks {tasks} needs --task I")
        if not 0 <= (task or 0) < tasks:
            raise ValueError(f"--task {task} is not one of the {tasks} tasks: 0 to {tasks - 1}")
        return Task(task or 0, tasks)
    array, ranked = "SLURM_ARRAY_TASK_ID" in environ, "RANK" in environ
    if array and ranked:
        raise ValueError("both a SLURM array task and a torchrun rank: pass --task I --tasks N")
    if array:
        first, count = int(environ.get("SLURM_ARRAY_TASK_MIN", 0)), int(
            environ["SLURM_ARRAY_TASK_COUNT"])
        index, off = divmod(int(environ["SLURM_ARRAY_TASK_ID"]) - first,
                            int(environ.get("SLURM_ARRAY_TASK_STEP", 1)))
        if off or not 0 <= index < count:
            raise ValueError(f"SLURM array task {environ['SLURM_ARRAY_TASK_ID']} is not one of "
                             f"{count} evenly spaced ids from {first}: submit the array as "
                             f"--array=0-{count - 1}, or pass --task I --tasks N")
        return Task(index, count)
    if ranked:
        return Task(int(environ["RANK"]), int(environ["WORLD_SIZE"]))
    return WHOLE_JOB
