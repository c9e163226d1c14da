"""Where a featurized set is written (`--out`): a local folder, an S3 bucket, or `pipe:` commands.

- a folder: each file written in a scratch folder inside it and renamed into place when whole;
- `s3://BUCKET/PREFIX`: boto3, so any S3-compatible store (MinIO, R2, GCS's XML API, ...) through
  the usual AWS settings (AWS_ENDPOINT_URL, AWS_PROFILE, ...); a file is one upload (multipart
  when large), which S3 shows whole or not at all;
- `pipe:COMMAND` with `{shard}` where the file's name goes (`pipe:aws s3 cp - s3://b/p/{shard}`,
  `pipe:gsutil cp - gs://b/p/{shard}`): the command gets the whole file on its standard input.
  Reading back (to skip finished work, and for the merge) runs `--out-read pipe:COMMAND` with
  `{shard}` (`pipe:gsutil cat gs://b/p/{shard}`), by default the copy turned around: `cp - DEST`
  becomes `cp DEST -`.

Every file is first written whole in a local scratch folder and then put, so a reader never sees a
part of one; a command that fails, or a put that fails, is one line naming the file. File names
are the set's relative paths (`train/shard-000000.tar`, `parts/000000.json`, `manifest.json`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Protocol

from defrag.files import TEMPORARY
from defrag.urls import ShardError, redact, s3_client

PLACEHOLDER = "{shard}"
TAR_BLOCK = 512  # bytes of a tar header: a shard that yields them through a read command is there

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")  # what a put file may be named


class Destination(Protocol):
    """Where a set's files go: `put` a whole local file under a name, `read` one back (None when
    it is not there), `size` of one (None when missing or not knowable), whether one is
    `present` (a command tells that much from a file's first bytes)."""

    location: str  # for messages, credentials masked
    sizes_known: bool  # whether `size` can tell (a command cannot)

    def scratch(self, label: str = "") -> Path: ...

    def put(self, name: str, file: Path) -> None: ...

    def read(self, name: str) -> bytes | None: ...

    def size(self, name: str) -> int | None: ...

    def present(self, name: str) -> bool: ...


def destination(out: str, read_command: str | None = None) -> Destination:
    """The destination `out` names (see the module doc); `read_command` only for `pipe:`."""
    if read_command is not None and not out.startswith("pipe:"):
        raise ValueError("--out-read is for a pipe: --out; other outputs are read back directly")
    if out.startswith("pipe:"):
        return Commands(out, read_command)
    if out.startswith("s3://"):
        return Bucket(out)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", out):
        raise ValueError(f"--out {redact(out)}: write to a folder, s3://BUCKET/PREFIX, or a "
                         f"pipe:COMMAND with {PLACEHOLDER} (e.g. pipe:gsutil cp - "
                         f"gs://bucket/prefix/{PLACEHOLDER})")
    return Folder(Path(out))


def _checked(name: str) -> str:
    if not _SAFE_NAME.fullmatch(name) or ".." in name.split("/"):
        raise ValueError(f"refusing to write {name!r}: a set's file names are [A-Za-z0-9_.-] "
                         f"words joined by '/'")
    return name


class Folder:
    """A local (or mounted network) folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)
        self.sizes_known = True

    def scratch(self, label: str = "") -> Path:
        """A new folder beside the set (the same file system: puts are renames); a `label`'s
        earlier folders, left by a killed task, are removed first."""
        self.root.mkdir(parents=True, exist_ok=True)
        if label:
            for leftover in self.root.glob(f"{TEMPORARY}{label}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"{TEMPORARY}{label}-", dir=self.root))

    def put(self, name: str, file: Path) -> None:
        target = self.root / _checked(name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)
        except OSError as err:
            raise ShardError(f"cannot write {name} into {self.location} ({err})") from err

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / _checked(name)).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, name: str) -> int | None:
        try:
            return (self.root / _checked(name)).stat().st_size
        except FileNotFoundError:
            return None

    def present(self, name: str) -> bool:
        return self.size(name) is not None


class Bucket:
    """`s3://BUCKET/PREFIX` through boto3 (credentials and endpoint from the AWS settings)."""

    def __init__(self, url: str) -> None:
        self.bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not self.bucket:
            raise ValueError(f"--out {redact(url)}: name a bucket, s3://BUCKET/PREFIX")
        self.prefix = prefix.strip("/")
        self.location = redact(url)
        self.sizes_known = True
        self.client = s3_client()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{_checked(name)}" if self.prefix else _checked(name)

    def scratch(self, label: str = "") -> Path:
        return Path(tempfile.mkdtemp(prefix=f"defrag-featurize-{label}-"))

    def put(self, name: str, file: Path) -> None:
        try:
            self.client.upload_file(str(file), self.bucket, self.key(name))
        except Exception as err:  # boto3's errors: ClientError, S3UploadFailedError, ...
            raise ShardError(f"cannot upload {name} to {self.location} "
                             f"({type(err).__name__}: {redact(str(err))})") from err
        file.unlink()

    def read(self, name: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None
        except Exception as err:
            raise ShardError(f"cannot read {name} from {self.location} ({type(err).__name__}: "
                             f"{redact(str(err))}){_forbidden(err)}") from err

    def size(self, name: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(name))["ContentLength"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise ShardError(f"cannot look up {name} in {self.location} ({redact(str(err))})"
                             f"{_forbidden(err)}") from err

    def present(self, name: str) -> bool:
        return self.size(name) is not None


def _forbidden(err: Exception) -> str:
    """S3 answers 403, not 404, for a missing object to credentials without s3:ListBucket."""
    if "403" not in str(err) and "AccessDenied" not in str(err):
        return ""
    return ("; for a file not written yet this means the credentials lack s3:ListBucket on the "
            "bucket: grant it (tasks look up what is finished)")


class Commands:
    """`pipe:COMMAND {shard}` to write a file from standard input, and one to read it back."""

    def __init__(self, write: str, read: str | None) -> None:
        self.write = write.removeprefix("pipe:")
        if PLACEHOLDER not in self.write:
            raise ValueError(f"--out {redact(write)}: a pipe: output needs {PLACEHOLDER} where "
                             f"each file's name goes, e.g. pipe:aws s3 cp - "
                             f"s3://bucket/prefix/{PLACEHOLDER}")
        self.read_command = (read or _turned_around(self.write)).removeprefix("pipe:")
        if PLACEHOLDER not in self.read_command:
            raise ValueError(f"--out-read {redact(read)}: it needs {PLACEHOLDER} too")
        self.location = redact(write)
        self.sizes_known = False
        self.said: str | None = None  # how the last read that failed ended

    def scratch(self, label: str = "") -> Path:
        return Path(tempfile.mkdtemp(prefix=f"defrag-featurize-{label}-"))

    def put(self, name: str, file: Path) -> None:
        command = self.write.replace(PLACEHOLDER, _checked(name))
        with file.open("rb") as stream:
            done = subprocess.run(command, shell=True, stdin=stream, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        if done.returncode:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise ShardError(f"cannot write {name}: `{redact(command)}` exited "
                             f"{done.returncode}{': ' + redact(said[-1]) if said else ''}")
        file.unlink()

    def read(self, name: str) -> bytes | None:
        """The file, or None when the read command fails (a missing file and an unreachable
        store look the same through a command: the caller then redoes the work)."""
        command = self.read_command.replace(PLACEHOLDER, _checked(name))
        done = subprocess.run(command, shell=True, stdin=subprocess.DEVNULL,
                              capture_output=True)  # its complaint about a missing file unshown
        if done.returncode:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            self.said = redact(f"`{command}` exited {done.returncode}"
                               f"{': ' + said[-1] if said else ''}")
            return None
        return done.stdout

    def size(self, name: str) -> int | None:
        return None

    def present(self, name: str) -> bool:
        """Whether the read command yields the file's first tar block (512 bytes); it is stopped
        there, so a lost shard is found without downloading the others whole."""
        command = self.read_command.replace(PLACEHOLDER, _checked(name))
        with subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True) as process:
            first = process.stdout.read(TAR_BLOCK)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the command and what it started
        return len(first) == TAR_BLOCK


def _turned_around(write: str) -> str:
    """`... cp - DEST ...` -> `... cp DEST - ...`: the read of a copy command's write, the rest
    of the command as it was (its quotes, variables and pipes)."""
    turned, swaps = re.subn(r"(?<!\S)cp(\s+)-(\s+)(\S*\{shard\}\S*)", r"cp\1\3\2-", write,
                            count=1)
    if not swaps:
        raise ValueError(f"pipe:{redact(write)}: give the command that reads a file back, "
                         f"--out-read 'pipe:COMMAND {PLACEHOLDER}' (e.g. pipe:gsutil cat "
                         f"gs://bucket/prefix/{PLACEHOLDER}); only `cp - DEST` commands are "
                         f"turned around by themselves")
    return turned


def write_text(where: Destination, name: str, text: str) -> None:
    """Put a small text file (a part, the vocabulary, the manifest) whole."""
    scratch = where.scratch()
    try:
        (scratch / "file").write_text(text, encoding="utf-8")
        where.put(name, scratch / "file")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
