"""Files written so that a kill never leaves a part (atomic writes) and folders whose every file is
checked before use (checksums.json): shards, manifests, vocabularies, caches, checkpoints, model
folders, the tracking spool."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

CHECKSUMS = "checksums.json"  # a folder's file list and fingerprints, written last
TEMPORARY = ".tmp-"  # marks a file being written beside its target: `<target name>.tmp-<id>`


@contextmanager
def replaced_atomically(target: Path, temporary: Path | None = None) -> Iterator[Path]:
    """A path beside `target` to write a file or folder at, renamed onto `target` when the block
    succeeds and removed when it fails: a reader (or a restart after a kill) sees the old
    target or the new, never a part. `temporary` names it when several processes write it."""
    temporary = temporary or target.with_name(f"{target.name}{TEMPORARY}{uuid.uuid4().hex[:8]}")
    try:
        yield temporary
        if temporary.is_dir() and target.is_dir():  # a rename replaces an empty folder only:
            # the old folder moved aside whole (a hidden name no `step-*`-like glob sees), never
            # half deleted, and put back if the new one cannot take its place
            retired = target.with_name(f".{target.name}{TEMPORARY}{uuid.uuid4().hex[:8]}")
            os.replace(target, retired)
            try:
                os.replace(temporary, target)
            except BaseException:
                os.replace(retired, target)
                raise
            shutil.rmtree(retired, ignore_errors=True)  # the new folder is in place: done
        else:
            os.replace(temporary, target)
    except BaseException:
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise


def recover_replaced(folder: Path) -> None:
    """Undo what a kill inside `replaced_atomically` left in `folder`: a retired folder whose new
    copy never took its place is put back, any other retired folder and every temporary removed.
    Only while nothing else writes to `folder` (a run's start)."""
    for leftover in sorted(folder.glob(f"*{TEMPORARY}*")) if folder.is_dir() else []:
        original = folder / leftover.name.partition(TEMPORARY)[0].removeprefix(".")
        if leftover.name.startswith(".") and leftover.is_dir() and not original.exists():
            os.replace(leftover, original)
        elif leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def write_atomically(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` (`replaced_atomically`)."""
    with replaced_atomically(path) as temporary:
        temporary.write_bytes(data.encode() if isinstance(data, str) else data)


def sha256_stream(stream: BinaryIO) -> str:
    """The sha256 (hex) of what is left to read in `stream`, read a block at a time."""
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of a file."""
    with path.open("rb") as stream:
        return sha256_stream(stream)


def fingerprint(path: Path) -> dict[str, Any]:
    """The sha256 and size of a file."""
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


def write_checksums(folder: Path, **fields: Any) -> None:
    """Write `folder`'s checksums.json (last): `fields`, and the fingerprint of every file (not
    of its subfolders: they hold their own)."""
    files = {p.name: fingerprint(p) for p in sorted(folder.iterdir())
             if p.name != CHECKSUMS and p.is_file()}
    (folder / CHECKSUMS).write_text(json.dumps({**fields, "files": files}, indent=2))


def verify_checksums(folder: Path, error: type[ValueError], what: str, advice: str = "",
                     subfolders: bool = False, **fields: Any) -> dict[str, Any]:
    """`folder`'s checksums.json once it has `fields`, every file it lists is intact, no other file
    is there and no link leads out of the folder; else `error` naming the file (`what` the folder
    should be), then `advice`. With `subfolders`, folders may be there too: the caller checks
    them."""
    def refuse(problem: str) -> ValueError:
        return error(f"{problem}; {advice}" if advice else problem)

    inside = folder.resolve()
    for path in sorted(folder.iterdir()):
        if not path.resolve().is_relative_to(inside):
            raise refuse(f"{path} is a link to {path.resolve()}, outside {folder}")
    try:
        manifest = json.loads((folder / CHECKSUMS).read_text())
        listed = {name: {"sha256": entry["sha256"], "size": entry["size"]}
                  for name, entry in manifest["files"].items()}
    except FileNotFoundError as err:
        raise error(f"{folder}: {CHECKSUMS} is missing; not a {what}, or an incomplete "
                    "copy") from err
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise refuse(f"{folder / CHECKSUMS} is malformed ({err!r})") from err
    for key, want in fields.items():
        if manifest.get(key) != want:
            raise refuse(f"{folder / CHECKSUMS}: {key} {manifest.get(key)!r}, this code reads "
                         f"{key} {want!r}")
    for name, expected in listed.items():
        path = folder / name
        if name != path.name or name == CHECKSUMS:
            raise refuse(f"{folder / CHECKSUMS} lists an invalid entry {name!r}")
        if not path.is_file():
            raise refuse(f"{path} is missing (incomplete copy)")
        if fingerprint(path) != expected:
            raise refuse(f"{path} does not match its checksum (altered or truncated)")
    present = {p.name for p in folder.iterdir() if not (subfolders and p.is_dir())}
    unlisted = sorted(present - set(listed) - {CHECKSUMS})
    if unlisted:
        raise refuse(f"{folder}: files not listed in {CHECKSUMS}: {unlisted}")
    return manifest
