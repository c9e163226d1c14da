"""Opening the URLs that shard sets live at: local paths, `pipe:` commands, http(s), `s3://` and
every other scheme of webdataset's `gopen`; small files (manifest, vocabulary) read whole, retried.

`s3://BUCKET/KEY` is read with boto3, so with the usual AWS settings (credentials, AWS_PROFILE,
AWS_ENDPOINT_URL for MinIO, R2, ... or a local test server), without the `aws` command.

http(s) is opened with curl, as webdataset does, but with a timeout, so that a stalled or refused
transfer ends after `timeout` seconds; curl's exit codes and HTTP statuses are put in words. The
URL and any credentials reach curl on its standard input (`--config -`), never on its command
line, which `ps` shows to every user: a password in the URL (`https://user:pw@host/...`, not
recommended), `~/.netrc` (`--netrc-optional`), or an `Authorization` header taken from the
environment variable DEFRAG_HTTP_AUTHORIZATION (e.g. `Bearer <token>`).

`redact` masks credentials wherever a URL or a config leaves the process (logs, error lines,
MLflow, model and checkpoint folders, JSON outputs).
"""

from __future__ import annotations

import http
import os
import posixpath
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, unquote, urlsplit

import webdataset as wds
from webdataset.gopen import Pipe

CURL_EXIT = {6: "unknown host", 7: "connection refused", 18: "connection closed mid-transfer",
             22: "HTTP error status (e.g. 404 Not Found)", 28: "timed out",
             52: "empty reply", 56: "connection reset"}


_BREAKS = re.compile(r"[\r\n\0]")  # a line break or NUL: in curl's config, a new setting
AUTHORIZATION_ENV = "DEFRAG_HTTP_AUTHORIZATION"  # the Authorization header of http(s) reads
MASK = "***"
# Query parameters and NAME=value settings whose value is a secret, by name, case-insensitive:
# signed URLs of AWS (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token), Google Cloud
# Storage (X-Goog-Signature, X-Goog-Credential; Signature of V2), Azure SAS (sig), CloudFront
# (Signature); OAuth and API keys (token, access_token, key, api_key, apikey); environment
# settings and flags of `pipe:` commands (AWS_SECRET_ACCESS_KEY=, AWS_SESSION_TOKEN=,
# --password=). Any name ending in signature, credential, token, secret, password, passwd,
# apikey, authorization, or in key after a separator (`_key`, `-key`, `.key`), and sig, pwd.
SECRET_NAME = (r"[\w.-]*?(?:signature|credential|token|secret|password|passwd|apikey|"
               r"authorization)|(?:[\w.-]*[-_.])?key|sig|pwd")
_REDACTIONS = [
    # user:password@ in a URL of any scheme (the user name kept), or a token as the user name
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s/?#'\"<>]*)@"),
     lambda m: f"{m[1]}{m[2].split(':')[0] + ':' if ':' in m[2] else ''}{MASK}@"),
    # NAME=value: a query parameter, an environment setting, a --flag=value
    (re.compile(rf"(?i)(?<![\w.-])({SECRET_NAME})=(?:(?!::|:\s|:$)[^\s&#'\"<>,;(){{}}\[\]])+"),
     lambda m: f"{m[1]}={MASK}"),
    # a secret flag's value (`--token abc`)
    (re.compile(rf"(?i)(?<!\S)(--?(?:{SECRET_NAME}))(\s+)(['\"]?)[^\s'\"]+"),
     lambda m: f"{m[1]}{m[2]}{m[3]}{MASK}"),
    # curl's -u/--user user:password
    (re.compile(r"(?<!\S)(-u|--user)(\s+|=)(['\"]?)([^\s'\":]*):[^\s'\"]+"),
     lambda m: f"{m[1]}{m[2]}{m[3]}{m[4]}:{MASK}"),
    # an Authorization header in text (`Authorization: Bearer abc`)
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)((?:basic|bearer|digest|token|"
                r"negotiate)\s+)?[^\s'\",;]+"),
     lambda m: f"{m[1]}{m[2] or ''}{MASK}"),
]


def redact(value: Any) -> Any:
    """`value` with every credential masked as MASK: in a string (a URL, a shard list, a `pipe:`
    command, an error line) and in the strings of nested dicts and lists (a config). Masking a
    masked value changes nothing, so masked values compare equal to themselves."""
    if isinstance(value, str):
        for pattern, replacement in _REDACTIONS:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, Mapping):
        return {key: redact(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(item) for item in value)
    return value


class ShardError(RuntimeError):
    """A shard or a manifest that cannot be read: missing, unreachable or damaged."""


class HttpError(OSError):
    """An http(s) or S3 read the server answered with an error status (`status`); `said` is how
    the reader put it (curl's exit, S3's error code)."""

    def __init__(self, status: int, text: str, said: str = "curl exit 22") -> None:
        super().__init__(text)
        self.status = status
        self.said = said

    @property
    def permanent(self) -> bool:
        """A client error that a retry cannot mend (401, 403, 404; not 408 or 429)."""
        return 400 <= self.status < 500 and self.status not in (408, 429)


class _Curl(Pipe):
    """curl's output as a stream; a failed transfer raises OSError (HttpError for an HTTP
    status) with curl's own error line, which it writes to a pipe of ours."""

    said: str | None = None

    def wait_for_child(self) -> None:
        try:
            super().wait_for_child()
        except OSError:
            if self.said is None:
                self.said = self.proc.stderr.read().decode(errors="replace").strip()
                self.proc.stderr.close()
            status = re.search(r"returned error: (\d{3})", self.said)
            text = f"curl exit {self.status}: {self.said}"
            raise (HttpError(int(status[1]), text) if status else OSError(text)) from None

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.proc.stderr.close()


def _curl_config(url: str) -> bytes:
    """curl's settings for `url` in its config-file syntax (read from its stdin): the URL, the
    URL's user:password as `user`, and the Authorization header of AUTHORIZATION_ENV. A value
    with a line break or NUL (`%0a` in user:password too, once decoded) is refused: it would
    add settings."""
    parts = urlsplit(url)
    settings = {}
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        settings["user"] = unquote(userinfo)
        settings["url"] = parts._replace(netloc=host).geturl()
    else:
        settings["url"] = url
    if os.environ.get(AUTHORIZATION_ENV):
        settings["header"] = f"Authorization: {os.environ[AUTHORIZATION_ENV]}"
        if _BREAKS.search(settings["header"]):
            raise ShardError(f"refusing {AUTHORIZATION_ENV}: it holds a line break or a NUL "
                             f"character, which would add curl settings; set it to the one "
                             f"header value (e.g. `Bearer <token>`)")
    if any(_BREAKS.search(value) for value in settings.values()):
        raise ShardError(_refused_url(url))
    return "".join(f'{name} = "{_escaped(value)}"\n' for name, value in settings.items()).encode()


def _refused_url(url: str) -> str:
    """The one line refusing a URL that holds a line break or NUL (decoded or not)."""
    return (f"refusing the URL {redact(url)!r}: it holds a line break or a NUL character, which "
            f"no shard or manifest URL has; check where it came from (a manifest's shard "
            f"\"file\", data.shards, data.manifest)")


def _escaped(value: str) -> str:
    """`value` inside double quotes of a curl config file."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def is_remote(url: str) -> bool:
    """Whether `url` is read over a network or a command rather than from a local file."""
    return url.startswith(("http://", "https://", "pipe:")) or "://" in url.split(" ")[0]


def open_url(url: str, timeout: float) -> IO[bytes]:
    """A binary stream of `url`: a path, `pipe:CMD`, `http(s)://` or any other scheme
    webdataset's gopen handles. http(s) transfers that stall for `timeout` s fail. A URL with
    a line break or NUL is refused: in curl's config (`_curl_config`) it would add settings."""
    if _BREAKS.search(url):
        raise ShardError(_refused_url(url))
    if url.startswith(("http://", "https://")):
        seconds = str(max(1, round(timeout)))
        command = ["curl", "--fail", "--silent", "--show-error", "--location", "--netrc-optional",
                   "--connect-timeout", seconds, "--speed-limit", "1", "--speed-time", seconds,
                   "--config", "-"]
        config = _curl_config(url)
        settings_read, settings_write = os.pipe()
        os.write(settings_write, config)  # far below a pipe's buffer: never blocks
        os.close(settings_write)
        try:
            # 23 and 141: curl stopped because the reader closed the stream early (SIGPIPE)
            return _Curl(command, mode="rb", bufsize=1 << 20, ignore_status=[23, 141],
                         timeout=timeout, stdin=settings_read, stderr=subprocess.PIPE)
        finally:
            os.close(settings_read)
    if url.startswith("s3://"):
        return _S3Object(url, timeout)
    return wds.gopen(url, "rb", bufsize=1 << 20)


def s3_client(timeout: float | None = None) -> Any:
    """A boto3 S3 client of the AWS settings as they are now (a new one each time: it costs tens
    of milliseconds, once per shard)."""
    import boto3
    from botocore.config import Config

    config = Config() if timeout is None else Config(  # our retries, not botocore's too
        connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1})
    return boto3.client("s3", config=config)


class _S3Object:
    """The body of `s3://BUCKET/KEY` as a binary stream; S3 and network errors become OSError
    (HttpError with S3's status), as every other stream's do."""

    def __init__(self, url: str, timeout: float) -> None:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        self.url = url
        self.body = self._call(lambda: s3_client(timeout).get_object(Bucket=bucket, Key=key)
                               )["Body"]

    def _call(self, action: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return action()
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "error")
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            raise HttpError(status, f"S3 {code}: {redact(str(err))}", f"S3 {code}") from None
        except BotoCoreError as err:
            raise OSError(f"S3 read of {redact(self.url)}: {redact(str(err))}") from None

    def read(self, size: int = -1) -> bytes:
        return self._call(lambda: self.body.read(None if size < 0 else size))

    def close(self) -> None:
        self.body.close()

    def __enter__(self) -> _S3Object:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HTTP_ADVICE = {
    401: f"the server wants credentials: put them in ~/.netrc or set {AUTHORIZATION_ENV} "
         f"(README.md, \"Shards on a web server or object storage\")",
    403: "the server refuses these credentials, or a signed URL has expired: check them, or "
         "sign the URL again"}


def describe_error(err: BaseException) -> str:
    """An exception of a stream as one line, curl's exit codes and HTTP statuses in words,
    credentials masked."""
    text = f"{type(err).__name__}: {err}"
    match = re.search(r"\bexit (\d+)", text)
    if isinstance(err, HttpError):
        text = f"{err.said}, HTTP {err.status} {_phrase(err.status)}"
        if err.status in HTTP_ADVICE:
            text += f": {HTTP_ADVICE[err.status]}"
    elif match and "curl" in text and int(match.group(1)) in CURL_EXIT:
        text = f"curl exit {match.group(1)}, {CURL_EXIT[int(match.group(1))]}"
    return redact(text.splitlines()[0]) if text else type(err).__name__


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "error"


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
            if isinstance(err, HttpError) and err.permanent:  # a retry would get the same
                raise ShardError(f"cannot read {redact(url)} ({describe_error(err)})") from err
            if attempt == retries:
                raise ShardError(f"cannot read {redact(url)} after {retries + 1} attempts "
                                 f"({describe_error(err)})") from err
            time.sleep(min(2.0 ** attempt, 10.0))
    raise AssertionError("unreachable")


def join_url(base: str, name: str) -> str:
    """The file `name` (a relative path) of the folder `base`, percent-encoded after an http(s)
    base, whose server decodes it (a split named "val 2014")."""
    if base.startswith(("http://", "https://")):
        name = quote(name)
    return f"{base.rstrip('/')}/{name}"


def parent(url: str) -> str:
    """The folder of a path or URL ("." for a bare name)."""
    return posixpath.dirname(url.rstrip("/")) or "."
