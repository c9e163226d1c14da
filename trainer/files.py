"""File helpers shared by checkpoints and the tracking spool."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` in one rename: a reader (or a restart after a kill) sees the
    old content or the new, never a part."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(partial, path)
