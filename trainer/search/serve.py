"""The search web app: a page and a JSON API over a search index (trainer/search/index.py) of a
photo collection: sentence -> images, image (indexed or uploaded) -> sentences, and why (Figure 4).

    defrag serve --index INDEX [--model DIR] [--host 127.0.0.1] [--port 8000]
                            [--workers CPUS] [--threads CPUS/WORKERS] [--max-upload-mb 10]
                            [--max-image-pixels 40000000] [--upload-slots 1]
    defrag serve --parts URL0,URL1,... [--part-timeout 2] [--host ...] [--port ...]
                            [--max-upload-mb 10] [--upload-slots 1]

Then open http://127.0.0.1:8000/ (the page), or see docs/search-app.md for the API and
/openapi.json for its schema. The page is plain HTML, JS and CSS from trainer/search/static:
nothing is fetched from the internet (FastAPI's /docs and /redoc, which load Swagger from a CDN, are
off).

--workers N worker processes (uvicorn's, default: the CPUs this process may run on, at most
8) serve the one listening socket, each with the index opened by itself (its rows and faiss
files memory-mapped read-only, so the workers share their pages), its own model and parser, and
CPUs / N torch and faiss threads (--threads). The parent opens the index once first, so that a
bad one stops the command in one line.

Within a worker, the searches are plain `def`: FastAPI runs them in its thread pool, several at
once; an upload is read and embedded in one of the worker's --upload-slots, taken before its
body is read (UploadSlots), then searched as the others are. SearchIndex serialises its parser
itself; the model only runs forward passes in eval mode, which torch allows from several
threads, so no lock is taken here. Every bad input answers a 4xx with {"error": "one line"} (a
busy server 503) and the server goes on.

--parts serves a split index (defrag index --parts N) instead: each URL a `defrag serve --index
INDEX/part-P`, in part order; this process answers the same API by asking them all
(trainer/search/split.py). For it each part also answers /api/fragments (an indexed image's
rows, sent to the parts that do not hold it; POST: an upload's rows, sent to every part).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import io
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from defrag.cli import add_debug_flag, describe, one_line_errors
from defrag.images import add_pixel_limit_flag
from defrag.urls import redact
from trainer.search.certificate import Hit
from trainer.search.embedder import RetrievalError
from trainer.search.fragment_set import FragmentSet
from trainer.search.index import MAX_QUERY_CHARS, SearchIndex
from trainer.search.web import (
    MAX_K,
    MIB,
    STATIC,
    UPLOAD_READ_SECONDS,
    UPLOAD_SLOTS,
    UPLOAD_WAIT_SECONDS,
    SplitHeader,
    UploadSlots,
    answer_errors_in_one_line,
    image_url,
    read_body,
    refuse_by_headers,
    split_label,
)

log = logging.getLogger(__name__)

MAX_FRAGMENTS = 1000  # rows of the image POST /api/fragments/sentences searches with
MAX_DEFAULT_WORKERS = 8  # a large node's CPUs go to threads beyond this, not to more copies
SETTINGS_VARIABLE = "DEFRAG_SERVE_WORKER"  # main() passes the workers their settings (JSON) in it
SUPERVISOR_VARIABLE = "DEFRAG_SERVE_SUPERVISOR"  # ... and the pid of the process that started them
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
LOG_FORMAT = "%(levelname)s %(message)s"
PART_TIMEOUT = 2.0  # seconds the front of a split index waits for each part's answer


class ErrorBody(BaseModel):
    """What every failed request answers."""

    error: str


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers an endpoint gives."""
    meaning = {400: "a bad input (the message says which)", 404: "not an indexed image",
               408: "the upload's body did not arrive in time (the connection is closed)",
               413: "the upload is over the size or pixel limit", 415: "the upload is not image/*",
               422: "a parameter is missing or out of range",
               503: "every upload slot stayed busy: send it again after Retry-After seconds"}
    return {code: {"model": ErrorBody, "description": meaning[code]} for code in codes}


def create_app(index: SearchIndex, max_upload_bytes: int, upload_slots: int = UPLOAD_SLOTS,
               upload_wait: float = UPLOAD_WAIT_SECONDS,
               upload_read: float = UPLOAD_READ_SECONDS) -> FastAPI:
    """The app over an opened index; uploads over `max_upload_bytes`, or over the index
    embedder's pixel bound (from the image header, before decoding), are refused (413); at most
    `upload_slots` uploads are read and decoded at once (UploadSlots), the others wait their
    turn, their bodies unread, for `upload_wait` seconds at most."""
    slots = UploadSlots(upload_slots, upload_wait, upload_read)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """Shut the decoding threads down when the server stops (its requests are answered)."""
        yield
        slots.threads.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(
        title="DeFrag search", version="1", docs_url=None, redoc_url=None, lifespan=lifespan,
        description="Search a photo collection with sentences, and sentences with photos, using "
                    "a Deep Fragment Embeddings model (Karpathy et al., NIPS 2014). Errors "
                    "answer {\"error\": message}.")
    answer_errors_in_one_line(app)
    _add_searches(app, index, max_upload_bytes)
    _add_upload_search(app, index, max_upload_bytes, slots)
    _add_explain(app, index)
    _add_fragments(app, index, max_upload_bytes)
    _add_files(app, index)
    if "split" in index.meta:
        app.add_middleware(SplitHeader, label=split_label(index.meta["split"]))
    return app


def _add_searches(app: FastAPI, index: SearchIndex, max_upload_bytes: int) -> None:
    """/api/info, and the searches of what the index holds: sentence -> images, indexed image
    -> sentences."""

    @app.get("/api/info", summary="The index and its model",
             description="The model folder and its checksums key, how many images and sentences "
                         "the index holds, and this server's limits.")
    def info() -> dict[str, Any]:
        return {"model": str(index.model_dir), "model_key": index.embedder.model_key,
                "images": len(index.image_names), "sentences": len(index.sentences),
                "max_query_chars": MAX_QUERY_CHARS, "max_upload_bytes": max_upload_bytes,
                "max_k": MAX_K, "max_image_pixels": index.embedder.max_image_pixels,
                **({"split": index.meta["split"]} if "split" in index.meta else {})}

    @app.get("/api/search", summary="Sentence -> best images", responses=_errors(400, 422),
             description="The k indexed images that best match the sentence `q`, best first, "
                         "with the model's score and the URL of each image.")
    def search(q: str = Query(description="the sentence to search for"),
               k: int = Query(10, ge=1, le=MAX_K, description="how many images")
               ) -> dict[str, Any]:
        found = index.images_for(q, k)
        return {"query": q, **found.proof(), "results": [
            {"rank": rank, "image": hit.item, "score": hit.score, "url": image_url(hit.item)}
            for rank, hit in enumerate(found.hits, 1)]}

    @app.get("/api/sentences", summary="Indexed image -> best sentences",
             responses=_errors(400, 422),
             description="The k sentences of the index that best describe the indexed image "
                         "`image` (a file name, as /api/search answers it), best first.")
    def sentences_for_image(
            image: str = Query(description="an indexed image's file name"),
            k: int = Query(10, ge=1, le=MAX_K, description="how many sentences")
    ) -> dict[str, Any]:
        found = index.sentences_for_image(image, k)
        return {"image": image, "url": image_url(image), **found.proof(),
                "results": sentence_results(found.hits)}


def _add_upload_search(app: FastAPI, index: SearchIndex, max_upload_bytes: int,
                       slots: UploadSlots) -> None:
    """POST /api/sentences: an uploaded image -> sentences; POST /api/fragments: its fragments
    (what the front of a split index has one part embed for every part to search with). Each
    upload is read and embedded in one of the upload `slots`."""

    async def embedded(request: Request) -> tuple[int, FragmentSet]:
        """The upload's size and fragments."""
        refuse_by_headers(request, max_upload_bytes)
        async with slots.taken():
            body = await slots.body(request, max_upload_bytes)
            return len(body), await slots.run(embed_upload, index, body)

    @app.post("/api/sentences", summary="Uploaded image -> best sentences",
              responses=_errors(400, 408, 413, 415, 422, 503),
              description="The k sentences of the index that best describe a new image: POST "
                          "the JPEG, PNG or WebP file's bytes as the body with Content-Type "
                          "image/*, "
                          f"at most {max_upload_bytes / MIB:g} MiB (--max-upload-mb) and "
                          f"{index.embedder.max_image_pixels} pixels (--max-image-pixels).",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "image/*": {"schema": {"type": "string", "format": "binary"}}}}})
    async def sentences_for_upload(
            request: Request,
            k: int = Query(10, ge=1, le=MAX_K, description="how many sentences")
    ) -> dict[str, Any]:
        size, image = await embedded(request)
        found = await run_in_threadpool(index.sentences_for_rows, image, k)
        return {"image": None, "bytes": size, **found.proof(),
                "results": sentence_results(found.hits)}

    @app.post("/api/fragments", summary="An uploaded image's fragments",
              responses=_errors(400, 408, 413, 415, 503), include_in_schema=False,
              description="The fragment embeddings of the uploaded image (float32 rows), with "
                          "the limits of POST /api/sentences: what POST "
                          "/api/fragments/sentences takes.")
    async def fragments_of_upload(request: Request) -> dict[str, Any]:
        _, image = await embedded(request)
        return {"image": None, "fragments": image.embeddings.tolist()}


def embed_upload(index: SearchIndex, body: bytearray) -> FragmentSet:
    """An upload's fragments, its bytes written to a temporary file for the model to read (and
    deleted); an error names "the uploaded file", not that file."""
    with tempfile.TemporaryDirectory(prefix="defrag-upload-") as folder:
        path = Path(folder) / "upload"
        path.write_bytes(body)
        try:
            return index.embed_file(path)
        except RetrievalError as err:
            raise type(err)(str(err).replace(str(path), "the uploaded file")) from err


def _add_explain(app: FastAPI, index: SearchIndex) -> None:
    """/api/explain: Figure 4 for a sentence and an indexed image, as PNG or its details."""

    @functools.lru_cache(maxsize=32)
    def explained(text: str, name: str) -> tuple[bytes, dict[str, Any]]:
        """Figure 4 as PNG bytes and its details; kept, since the page asks for both."""
        picture, details = index.explain(text, name)
        png = io.BytesIO()
        picture.save(png, format="PNG")
        return png.getvalue(), details

    @app.get("/api/explain", summary="Why an image matches a sentence (Figure 4)",
             responses={**_errors(400, 422), 200: {
                 "content": {"image/png": {}, "application/json": {}},
                 "description": "the picture (PNG), or its details with format=json"}},
             description="The paper's Figure 4 for the sentence `q` and the indexed image "
                         "`image`: each sentence fragment linked to its best box (for a "
                         "whole-sentence model, each word's contribution to the score). "
                         "format=json answers what the picture shows.")
    def explain(q: str = Query(description="the sentence"),
                image: str = Query(description="an indexed image's file name"),
                format: Literal["png", "json"] = Query("png", description="png or json")
                ) -> Response:
        png, details = explained(q, image)
        if format == "json":
            return JSONResponse(details)
        return Response(png, media_type="image/png")


def _add_fragments(app: FastAPI, index: SearchIndex, max_upload_bytes: int) -> None:
    """An indexed image's fragments, and the sentences of the index for an image's fragments:
    what the front of a split index (trainer/search/split.py) sends from one part to every part
    (an upload's fragments: `_add_upload_search`), so that each scores the same rows, those the
    one-part index would (the front's requests, left out of /openapi.json; docs/search-app.md
    lists them)."""

    @app.get("/api/fragments", summary="An indexed image's fragments",
             responses=_errors(400, 422), include_in_schema=False,
             description="The fragment embeddings of the indexed image `image` as the index "
                         "stores them (float32 rows): what POST /api/fragments/sentences takes.")
    def fragments(image: str = Query(description="an indexed image's file name")
                  ) -> dict[str, Any]:
        rows = index.images.select([index.position_of(image)]).embeddings
        return {"image": image, "fragments": rows.tolist()}

    @app.post("/api/fragments/sentences", summary="Fragments -> best sentences",
              responses=_errors(400, 413, 422), include_in_schema=False,
              description="The k sentences of the index that best describe the image whose "
                          'fragments the JSON body gives: {"fragments": [[...], ...]}, 1 to '
                          f"{MAX_FRAGMENTS} rows of the model's dimension (as GET "
                          "/api/fragments answers them).",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"type": "object"}}}}})
    async def sentences_for_fragments(
            request: Request,
            k: int = Query(10, ge=1, le=MAX_K, description="how many sentences")
    ) -> dict[str, Any]:
        body = await read_body(request, max_upload_bytes, UPLOAD_READ_SECONDS)
        rows = fragment_rows(bytes(body), index.images.rows.shape[1])
        query = FragmentSet(["image"], rows, torch.zeros(len(rows), dtype=torch.long),
                            torch.zeros(len(rows), 4))
        found = await run_in_threadpool(index.sentences_for_rows, query, k)
        return {"image": None, **found.proof(), "results": sentence_results(found.hits)}


def fragment_rows(body: bytes, dims: int) -> torch.Tensor:
    """The rows of a {"fragments": [[...], ...]} body: 1 to MAX_FRAGMENTS finite rows of `dims`
    numbers, as float32; else 400 saying what is wrong."""
    wanted = (f'send {{"fragments": [[...], ...]}}: 1 to {MAX_FRAGMENTS} rows of {dims} '
              "numbers")
    try:
        rows = np.asarray(json.loads(body)["fragments"], np.float32)
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as err:
        raise HTTPException(400, f"{wanted} ({describe(err)})") from None
    if rows.ndim != 2 or rows.shape[1] != dims or not 1 <= len(rows) <= MAX_FRAGMENTS:
        raise HTTPException(400, f"{wanted} (got the shape {list(rows.shape)})")
    if not np.isfinite(rows).all():
        raise HTTPException(400, f"{wanted} (got a number that is not finite)")
    return torch.from_numpy(rows)


def _add_files(app: FastAPI, index: SearchIndex) -> None:
    """The page (/, /static/...) and the indexed image files (/images/NAME)."""

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/images/{name}", summary="An indexed image file", responses=_errors(404),
             description="The file of an indexed image. Only the index's own file names are "
                         "served, and only while the file (resolved at each request) is still "
                         "in the indexed folder; anything else is 404.")
    def image_file(name: str) -> FileResponse:
        try:
            path = index.image_file(name)
        except RetrievalError as err:  # gone or re-linked out: one line naming no path
            raise HTTPException(404, describe(err)) from err
        return FileResponse(path)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")


def sentence_results(hits: list[Hit]) -> list[dict[str, Any]]:
    return [{"rank": rank, "sentence": hit.item, "score": hit.score}
            for rank, hit in enumerate(hits, 1)]


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What each worker process opens and serves; main() passes it through the environment,
    since uvicorn starts its workers from an import string (app_from_env)."""

    index: str
    model: str | None
    max_upload_bytes: int
    max_image_pixels: int
    upload_slots: int
    threads: int  # the worker's torch and faiss threads
    debug: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def app_from_env() -> FastAPI:
    """uvicorn's app factory in each worker process: the index of the settings in
    SETTINGS_VARIABLE, opened by this process. One that fails is one error line and uvicorn's
    start-up failure status, on which uvicorn stops the server (on any other it would start the
    worker again, and again)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    stop_with_supervisor(int(os.environ[SUPERVISOR_VARIABLE]))
    settings = WorkerSettings(**json.loads(os.environ[SETTINGS_VARIABLE]))
    try:
        index = SearchIndex.open(Path(settings.index), settings.model and Path(settings.model),
                                 settings.max_image_pixels)
        return worker_app(index, settings)
    except Exception as err:
        log.error("defrag serve: error: worker %d: %s", os.getpid(), describe(err),
                  exc_info=settings.debug)
        sys.exit(STARTUP_FAILURE)


def stop_with_supervisor(supervisor: int) -> None:
    """Linux: this worker gets SIGTERM (uvicorn's graceful stop) when its supervisor dies, so a
    `defrag serve` killed by SIGKILL (kill -9, the OOM killer) leaves no worker on its port."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def worker_app(index: SearchIndex, settings: WorkerSettings) -> FastAPI:
    """The app of one worker over its opened index, with its threads and the parser loaded."""
    torch.set_num_threads(settings.threads)
    faiss.omp_set_num_threads(settings.threads)
    index.warm_up()
    return create_app(index, settings.max_upload_bytes, settings.upload_slots)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> None:
    """`defrag serve --index INDEX`: open the index, then serve until interrupted; or
    `--parts URL,...`: the front of a split index (trainer/search/split.py)."""
    cpus = available_cpus()
    parser = argparse.ArgumentParser(prog="defrag serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument("--index", type=Path, help="a search index folder (defrag index)")
    served.add_argument("--parts", help="the base URLs of the parts of a split index, in part "
                                        "order, separated by commas: each a defrag serve "
                                        "--index INDEX/part-P (defrag index --parts N)")
    parser.add_argument("--part-timeout", type=float, default=PART_TIMEOUT,
                        help=f"with --parts: seconds each part's answer is waited for, then the "
                             f"answer goes without it, \"exact\": false and the part named in "
                             f"\"missing_parts\" (default {PART_TIMEOUT:g})")
    parser.add_argument("--model", type=Path,
                        help="model folder (default: the one that built the index)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int,
                        help=f"worker processes, each with the index open and its own model and "
                             f"parser, ~0.5 GiB each plus the model (default: the CPUs this "
                             f"process may run on, at most {MAX_DEFAULT_WORKERS}: "
                             f"{min(cpus, MAX_DEFAULT_WORKERS)} here)")
    parser.add_argument("--threads", type=int,
                        help="torch and faiss threads of each worker (default: CPUs / workers, "
                             "at least 1)")
    parser.add_argument("--max-upload-mb", type=float, default=10.0,
                        help="largest image upload, in MiB (default 10)")
    add_pixel_limit_flag(parser)
    parser.add_argument("--upload-slots", type=int, default=UPLOAD_SLOTS,
                        help=f"uploads each worker reads and decodes at once (default "
                             f"{UPLOAD_SLOTS}); the others wait, their bodies unread, "
                             f"{UPLOAD_WAIT_SECONDS:g} s at most, then answer 503: peak memory "
                             f"grows by about workers x this x 8 bytes x --max-image-pixels")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.parts:
        serve_front(parser, args)
        return
    args.workers = min(cpus, MAX_DEFAULT_WORKERS) if args.workers is None else args.workers
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_upload_mb <= 0:
        parser.error(f"--max-upload-mb must be > 0, got {args.max_upload_mb}")
    if args.upload_slots < 1:
        parser.error(f"--upload-slots must be >= 1, got {args.upload_slots}")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    settings = WorkerSettings(str(args.index), args.model and str(args.model),
                              int(args.max_upload_mb * MIB), args.max_image_pixels,
                              args.upload_slots, args.threads or max(1, cpus // args.workers),
                              args.debug)
    with one_line_errors(parser.prog, args.debug):  # here once, not in each worker
        index = SearchIndex.open(args.index, args.model, args.max_image_pixels)
        app = worker_app(index, settings) if args.workers == 1 else None
    # once for every worker (the page cache is shared), beside them: it reads at disk speed
    threading.Thread(target=index.read_ahead, name="read-ahead", daemon=True).start()
    log.info("serving %d images and %d sentences of %s: %d worker(s) of %d thread(s)",
             len(index.image_names), len(index.sentences), args.index, args.workers,
             settings.threads)
    if app is not None:  # one worker: this process
        uvicorn.run(app, host=args.host, port=args.port)
    else:
        del index  # each worker opens its own
        serve_in_workers(settings, args.host, args.port, args.workers)


def serve_front(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`defrag serve --parts URL,...`: check that the parts make one split index, in order, then
    serve its front in this process until interrupted."""
    from trainer.search.split import PartClient  # it builds on this module

    given = [flag for flag, value in (("--model", args.model), ("--workers", args.workers),
                                      ("--threads", args.threads)) if value is not None]
    if given:
        parser.error(f"{', '.join(given)}: for --index (a front opens no index: one process "
                     "asks the parts)")
    if args.part_timeout <= 0:
        parser.error(f"--part-timeout must be > 0, got {args.part_timeout}")
    if args.max_upload_mb <= 0 or args.upload_slots < 1:
        parser.error("--max-upload-mb must be > 0 and --upload-slots >= 1")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request to a part
    with one_line_errors(parser.prog, args.debug):
        parts = PartClient.connect(args.parts.split(","), args.part_timeout)
        app = parts.app(int(args.max_upload_mb * MIB), args.upload_slots)
    log.info("serving the %d parts of a split index (%d images, %d sentences): %s",
             len(parts.parts), parts.total("images"), parts.total("sentences"), redact(args.parts))
    uvicorn.run(app, host=args.host, port=args.port)


def serve_in_workers(settings: WorkerSettings, host: str, port: int, workers: int) -> None:
    """uvicorn's supervisor and its `workers` processes (app_from_env) on one listening socket,
    until interrupted; exit status 1 if workers could not start."""
    os.environ[SETTINGS_VARIABLE] = settings.to_json()
    os.environ[SUPERVISOR_VARIABLE] = str(os.getpid())
    config = uvicorn.Config("trainer.search.serve:app_from_env", factory=True, host=host,
                            port=port, workers=workers)
    # uvicorn binds it with protocol 0, for which asyncio leaves Nagle's algorithm on: each
    # keep-alive request would wait for a delayed ACK, 40 ms (uvicorn issue #3149). The same
    # socket, its protocol read from the kernel (TCP):
    listener = socket.socket(fileno=config.bind_socket().detach())
    supervisor = Multiprocess(config, sockets=[listener])
    supervisor.run()
    failed = sum(process.exitcode == STARTUP_FAILURE for process in supervisor.processes)
    if failed:
        sys.exit(f"defrag serve: error: {failed} of {workers} workers could not start: their "
                 f"lines are above")
