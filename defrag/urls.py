"""Opening the URLs that shard sets live at: local paths, `pipe:` commands, http(s) and every
other scheme of webdataset's `gopen`; small files (manifest, vocabulary) read whole, retried.

http(s) is opened with curl, as webdataset does, but with a timeout, so that a stalled or refused
transfer ends after `timeout` seconds; curl's exit codes are put in words.
"""

from __future__ import annotations

import posixpath
import re
import time
from pathlib import Path
from typing import IO

import webdataset as wds
from webdataset.gopen import Pipe

CURL_EXIT = {6: "unknown host", 7: "connection refused", 18: "connection closed mid-transfer",
             22: "HTTP error status (e.g. 404 Not Found)", 28: "timed out",
             52: "empty reply", 56: "connection reset"}


class ShardError(RuntimeError):
    """A shard or a manifest that cannot be read: missing, unreachable or damaged."""


def is_remote(url: str) -> bool:
    """Whether `url` is read over a network or a command rather than from a local file."""
    return url.startswith(("http://", "https://", "pipe:")) or "://" in url.split(" ")[0]


def open_url(url: str, timeout: float) -> IO[bytes]:
    """A binary stream of `url`: a path, `pipe:CMD`, `http(s)://` or any other scheme
    webdataset's gopen handles. http(s) transfers that stall for `timeout` s fail."""
    if url.startswith(("http://", "https://")):
        seconds = str(max(1, round(timeout)))
        command = ["curl", "--fail", "--silent", "--show-error", "--location",
                   "--connect-timeout", seconds, "--speed-limit", "1", "--speed-time", seconds,
                   url]
        # 23 and 141: curl stopped because the reader closed the stream early (SIGPIPE)
        return Pipe(command, mode="rb", bufsize=1 << 20, ignore_status=[23, 141],
                    timeout=timeout)
    return wds.gopen(url, "rb", bufsize=1 << 20)


def describe_error(err: BaseException) -> str:
    """An exception of a stream as one line, curl's exit codes in words."""
    text = f"{type(err).__name__}: {err}"
    match = re.search(r"\bexit (\d+)", text)
    if match and "curl" in text and int(match.group(1)) in CURL_EXIT:
        text = f"curl exit {match.group(1)}, {CURL_EXIT[int(match.group(1))]}"
    return text.splitlines()[0] if text else type(err).__name__


def read_url(url: str, timeout: float = 60.0, retries: int = 3) -> bytes:
    """The whole content of a small file (manifest, vocabulary) at any URL, retried."""
    if not is_remote(url):
        try:
            return Path(url).read_bytes()
        except OSError as err:
            raise ShardError(f"cannot read {url} ({err})") from err
    for attempt in range(retries + 1):
        try:
            with open_url(url, timeout) as stream:
                return stream.read()
        except (OSError, ValueError) as err:
            if attempt == retries:
                raise ShardError(f"cannot read {url} after {retries + 1} attempts "
                                 f"({describe_error(err)})") from err
            time.sleep(min(2.0 ** attempt, 10.0))
    raise AssertionError("unreachable")


def join_url(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def parent(url: str) -> str:
    """The folder of a path or URL ("." for a bare name)."""
    return posixpath.dirname(url.rstrip("/")) or "."
