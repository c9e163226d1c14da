"""Atomic checkpoints: each is written to a temporary folder, renamed when complete, and only
then named by the `latest` file. A run killed at any moment resumes from the newest complete one.

    <run_dir>/checkpoints/step-00000120/   engine files (safetensors + optimizer, or DeepSpeed's)
                                           and state.json (epoch, step, best val rsum, MLflow run)
    <run_dir>/checkpoints/latest           the name of the newest complete checkpoint
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

TMP_PREFIX = "tmp-"


@dataclass
class TrainState:
    """Where the loop stands; saved with every checkpoint."""

    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # batches of `epoch` already trained
    global_step: int = 0
    best_rsum: float = float("-inf")
    best_epoch: int = -1
    finetunes_cnn: bool = False  # the phase of the engine that saved the checkpoint
    mlflow_run_id: str | None = None


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(engine, state: TrainState, run_dir: Path, rank: int, keep: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder."""
    root = checkpoints_dir(run_dir)
    name = f"step-{state.global_step:08d}"
    tmp = root / f"{TMP_PREFIX}{name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    engine.save(tmp, rank)
    _barrier()
    final = root / name
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomically(root / "latest", name)
        _prune(root, keep, final)
    _barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = checkpoints_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"{pointer} names {folder.name}, which is missing or incomplete; "
                                "remove the pointer to start over or restore the folder")
    return folder


def load_state(folder: Path) -> TrainState:
    return TrainState(**json.loads((folder / "state.json").read_text()))


def clear_partial(run_dir: Path) -> None:
    """Remove temporary folders a killed save left behind (never trusted, never resumed)."""
    root = checkpoints_dir(run_dir)
    for leftover in root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)


def _prune(root: Path, keep: int, newest: Path) -> None:
    saved = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in saved[:-keep] if keep > 0 else []:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
