"""Atomic, verified checkpoints: each is written to a temporary folder, its checksums last, renamed
when complete, and only then named by the `latest` file. A run killed at any moment resumes from
the newest complete one; a write that fails (a full disk) raises CheckpointError naming the
checkpoint and leaves `latest` as it was.

    <run_dir>/checkpoints/step-00000120/   engine files (safetensors + optimizer, or DeepSpeed's),
                                           state.json (epoch, step, best val rsum, MLflow run),
                                           config.json (the run's config, credentials masked) and
                                           checksums.json (sha256 and size of every other file)
    <run_dir>/checkpoints/latest           the name of the newest complete checkpoint

Resuming verifies every file (and refuses links out of the folder): `latest` falls back to the
newest intact checkpoint, logging which it skipped and why; a named one must be intact. The new
config is then compared with the checkpoint's (`resume_changes`): a change of what the
checkpoint means (trainer/config.py RESUME_FIXED) is refused before anything else happens.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from safetensors import SafetensorError

from defrag.files import (
    CHECKSUMS,
    recover_replaced,
    replaced_atomically,
    verify_checksums,
    write_atomically,
    write_checksums,
)
from defrag.urls import redact
from trainer.config import RESUME_FIXED, RESUME_FIXED_MID_EPOCH, Config, ConfigError
from trainer.store.tracking import flatten

TMP_PREFIX = "tmp-"
CONFIG = "config.json"  # the config a checkpoint was trained with
# DeepSpeed's ZeRO files, one per rank: DeepSpeed 0.19 loads them only on the world size that
# wrote them (ZeRORuntimeException otherwise, unless converted to a universal checkpoint)
ZERO_PARTITIONS = "*zero_pp_rank_*"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, or is damaged; the message names the file."""


@dataclass
class TrainState:
    """Where the loop stands; saved with every checkpoint."""

    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # batches of `epoch` already trained
    global_step: int = 0
    best_score: float = float("-inf")  # the best val figure: rsum, or minus dev perplexity
    best_epoch: int = -1
    finetunes_cnn: bool = False  # the phase of the engine that saved the checkpoint
    mlflow_run_id: str | None = None
    world_size: int | None = None  # the ranks that saved it (None: saved by an earlier version)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(engine, state: TrainState, run_dir: Path, rank: int, keep: int,
                    config: Config) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder."""
    root = checkpoints_dir(run_dir)
    name = f"step-{state.global_step:08d}"
    tmp = root / f"{TMP_PREFIX}{name}"  # every rank's engine writes into it
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with _failure_named(tmp):
        engine.save(tmp, rank)
    _barrier()
    final = root / name
    state.world_size = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        with _failure_named(tmp):
            with replaced_atomically(final, tmp):
                (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
                config.to_json(tmp / CONFIG)
                write_checksums(tmp)  # last: a folder without them is never resumed
            write_atomically(root / "latest", name)
        _prune(root, keep, final)
    _barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint up to the one `latest` names (None without `latest`); each
    damaged one skipped is logged with the reason."""
    pointer = checkpoints_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    named = pointer.read_text().strip()
    older = sorted((p.name for p in pointer.parent.glob("step-*") if p.name < named), reverse=True)
    skipped = []
    for name in [named, *older]:
        try:
            folder = verify_checkpoint(pointer.parent / name)
        except CheckpointError as err:
            skipped.append(f"skipping checkpoint {name} ({err})")
            continue
        for line in skipped:
            log.warning("%s; resuming from %s", line, name)
        return folder
    raise CheckpointError(f"no intact checkpoint in {pointer.parent}: {skipped[0]}; restore one, "
                          "or start over with --resume none")


def verify_checkpoint(folder: Path, advice: str = "") -> Path:
    """`folder`, once every file matches its checksums; else CheckpointError naming the file.
    A checkpoint of an earlier version (a state.json, no checksums.json) is used unverified,
    with a warning: a run upgraded mid-way resumes."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if (folder / "state.json").is_file() and not (folder / CHECKSUMS).exists():
        log.warning("checkpoint %s has no %s (written by an earlier version): resuming from it "
                    "unverified", folder, CHECKSUMS)
        return folder
    verify_checksums(folder, CheckpointError, "checkpoint", advice)
    return folder


def load_state(folder: Path) -> TrainState:
    state = json.loads((folder / "state.json").read_text())
    if "best_rsum" in state:  # written before the captioner shared the state
        state["best_score"] = state.pop("best_rsum")
    return TrainState(**state)


def resume_changes(folder: Path, state: TrainState, config: Config,
                   world_size: int) -> list[str]:
    """Each key `config` changes from the config `folder` was trained with, as `key: old -> new`,
    once none of them changes what the checkpoint means (RESUME_FIXED; mid-epoch also
    RESUME_FIXED_MID_EPOCH and the world size, as do DeepSpeed's ZeRO partitions); else
    ConfigError listing those. A key the checkpoint predates counts as its default."""
    refused = []
    if state.world_size not in (None, world_size) and (
            state.step_in_epoch or any(folder.glob(ZERO_PARTITIONS))):
        refused.append(f"world size: {state.world_size} -> {world_size}")
    path = folder / CONFIG
    changed = {}
    if path.is_file():
        old = {**flatten(_as_saved(Config())), **flatten(json.loads(path.read_text()))}
        new = flatten(_as_saved(config))
        changed = {key: f"{key}: {old[key]} -> {new[key]}"
                   for key in sorted(new) if old[key] != new[key]}
    else:
        log.warning("checkpoint %s has no %s (written by an earlier version): resuming without "
                    "comparing its config with this one", folder, CONFIG)
    fixed = RESUME_FIXED | (RESUME_FIXED_MID_EPOCH if state.step_in_epoch else frozenset())
    refused = [line for key, line in changed.items() if key in fixed] + refused
    if refused:
        raise ConfigError(f"cannot resume {folder} with this config: {', '.join(refused)}; the "
                          "checkpoint was trained with the old values (trainer/config.py "
                          "RESUME_FIXED says why): set them back, or start a new run (another "
                          "run.run_dir, or --resume none)")
    return list(changed.values())


def _as_saved(config: Config) -> dict:
    """A config as its checkpoint keeps it (Config.to_json): credentials masked, on both sides
    of the comparison, so a rotated password is no change."""
    return redact(config.to_dict())


def clear_partial(run_dir: Path) -> None:
    """Remove what a killed save left behind (never trusted, never resumed): its temporary
    folders and files, and a replaced checkpoint's old copy (put back if the new one is not
    there)."""
    root = checkpoints_dir(run_dir)
    for leftover in root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)
    recover_replaced(root)


@contextmanager
def _failure_named(tmp: Path) -> Iterator[None]:
    """Turn a failed write (a full disk) into one CheckpointError naming the checkpoint and what
    `latest` still is; the partial folder is removed."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as err:
        root = tmp.parent
        detail = (str(err).splitlines() or [type(err).__name__])[0]
        # safetensors removes its partial file; torch.save says only "unexpected pos"
        if os.strerror(errno.ENOSPC) in detail or shutil.disk_usage(root).free < 1 << 20:
            detail = f"the disk is full, ENOSPC ({detail})"
        shutil.rmtree(tmp, ignore_errors=True)
        pointer = root / "latest"
        latest = pointer.read_text().strip() if pointer.is_file() else "none"
        raise CheckpointError(f"cannot write checkpoint {root / tmp.name.removeprefix(TMP_PREFIX)}"
                              f": {detail}; latest is still {latest}: free space (or fix the "
                              "cause), then resume") from err


def _prune(root: Path, keep: int, newest: Path) -> None:
    saved = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in saved[:-keep] if keep > 0 else []:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
