"""What every app of the search JSON API shares (the one over an index, trainer/search/serve.py,
and the front of a split index, trainer/search/split.py): its limits, its one-line error
answers, the upload slots and the checks of an upload's headers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from defrag.cli import describe
from trainer.search.embedder import ImageTooLargeError, RetrievalError

STATIC = Path(__file__).parent / "static"
MIB = 2**20
MAX_K = 100  # results one request may ask for
UPLOAD_SLOTS = 1  # uploads a worker decodes at once: memory grows by workers x this x one upload
UPLOAD_WAIT_SECONDS = 10.0  # an upload waits this long for a slot, its body unread, then 503
UPLOAD_READ_SECONDS = 60.0  # a slot's upload must arrive within this, then 408 (a slow sender)
RETRY_AFTER_SECONDS = 5  # what a 503 for a busy server tells the client to wait
SPLIT_HEADER = "x-defrag-split"  # on every answer of a part of a split index: "ID PART/PARTS"


def answer_errors_in_one_line(app: FastAPI) -> None:
    """Every failure answers {"error": one line}: a bad input 400, a too large image 413, the
    HTTP errors and bad parameters their own status, a bug 500."""

    @app.exception_handler(RetrievalError)
    async def bad_input(request: Request, err: RetrievalError) -> JSONResponse:
        return JSONResponse({"error": describe(err)}, status_code=400)

    @app.exception_handler(ImageTooLargeError)
    async def too_many_pixels(request: Request, err: ImageTooLargeError) -> JSONResponse:
        return JSONResponse({"error": describe(err)}, status_code=413)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(err.detail)}, status_code=err.status_code,
                            headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = ("{}: {}".format(".".join(str(part) for part in e["loc"][1:]) or e["loc"][0],
                                    e["msg"]) for e in err.errors())
        return JSONResponse({"error": "; ".join(problems)}, status_code=422)

    @app.exception_handler(Exception)
    async def failure(request: Request, err: Exception) -> JSONResponse:
        """A bug: one line for the page; uvicorn logs the traceback."""
        return JSONResponse({"error": f"internal error: {describe(err)}"}, status_code=500)


class UploadSlots:
    """At most `count` uploads of a worker read and embedded at once. A slot is taken before an
    upload's body is read, so an upload waiting for one holds no more of its body than uvicorn's
    buffer of a connection, whatever the number of clients. A slot is waited for `wait` seconds
    at most (then 503 with Retry-After), its body must arrive within `read` seconds (then 408: a
    slow sender does not keep it), and its image is embedded by the slot's own thread (so that
    the memory the allocator keeps after a decode is kept by those few threads only)."""

    def __init__(self, count: int, wait: float, read: float) -> None:
        self.count, self.wait, self.read = count, wait, read
        self.free = asyncio.Semaphore(count)
        self.threads = ThreadPoolExecutor(count, thread_name_prefix="upload")

    @contextlib.asynccontextmanager
    async def taken(self) -> AsyncIterator[None]:
        """A slot, held while the request reads and embeds its upload; 503 if none frees."""
        try:
            async with asyncio.timeout(self.wait):
                await self.free.acquire()
        except TimeoutError:
            raise HTTPException(503, f"the server is busy with other uploads ({self.count} at a "
                                     "time): send it again in a few seconds",
                                headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        try:
            yield
        finally:
            self.free.release()

    async def body(self, request: Request, limit: int) -> bytearray:
        """The upload's bytes, read no further than `limit` (413) and within `read` seconds
        (408, and the connection is closed)."""
        body = await read_body(request, limit, self.read)
        if not body:
            raise HTTPException(400, "the upload is empty: send an image file's bytes")
        return body

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a slot's thread."""
        return await asyncio.wrap_future(self.threads.submit(function, *args))


async def read_body(request: Request, limit: int, seconds: float) -> bytearray:
    """A request's body, read no further than `limit` bytes (413) and within `seconds` (408,
    and the connection is closed: a slow sender does not keep the server's attention)."""
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big(limit)
    except TimeoutError:
        raise HTTPException(408, f"the upload did not arrive within {seconds:g} s: send it "
                                 "again over a faster connection",
                            headers={"Connection": "close"}) from None
    return body


def too_big(limit: int) -> HTTPException:
    return HTTPException(413, f"the upload is over the limit of {limit / MIB:g} MiB: send a "
                              "smaller image")


def refuse_by_headers(request: Request, max_upload_bytes: int) -> None:
    """415 unless the body is image/*, 413 for a Content-Length over the limit: before an
    upload waits for a slot."""
    kind = request.headers.get("content-type", "")
    if not kind.startswith("image/"):
        got = f"got {kind!r}" if kind else "got none"
        raise HTTPException(415, "send the image file's bytes as the body with Content-Type "
                                 f"image/jpeg, image/png or image/webp ({got})")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_upload_bytes:
        raise too_big(max_upload_bytes)


def split_label(split: dict[str, Any] | None) -> str | None:
    """SPLIT_HEADER's value for a part of a split index (its index.json's `split`), None for an
    index that is not a part."""
    return None if split is None else f"{split['id']} {split['part']}/{split['parts']}"


class SplitHeader:
    """ASGI middleware of a part's server: every answer carries SPLIT_HEADER, so that a front
    (trainer/search/split.py) tells a part that now serves another index from the one it checked
    at its start."""

    def __init__(self, app: Any, label: str) -> None:
        self.app, self.header = app, (SPLIT_HEADER.encode(), label.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_labelled(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)
        await self.app(scope, receive, send_labelled if scope["type"] == "http" else send)


def image_url(name: str) -> str:
    return f"/images/{quote(name, safe='')}"
