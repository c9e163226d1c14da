"""The front of a split index (`defrag index --parts N`: INDEX/part-0 ... part-(N-1), each an
ordinary index of a consecutive slice of the images and of the sentences): the search web app's
JSON API (trainer/search/serve.py) answered by asking every part, each a plain `defrag serve
--index INDEX/part-P`, at once, and merging their answers as the one-part index ranks.

The top k is the best k of the parts' top k by score, equal scores in part order and then in
each part's order: the one-part index's, whose ties go in index order, of which the parts are
consecutive slices. It is certified ("exact") when every part answered and each part's is. A
part that fails or does not answer within the timeout is left out: the answer holds the other
parts' results, "exact": false and "missing_parts" naming it, and the front logs one WARNING
line; the part's error text is never passed on (a part's refusal of a bad input, 4xx, is). Every
answer of a part names its split and part (SPLIT_HEADER): one that names another than the front
checked at its start (the part's server restarted on another index) is a missing part too.

An indexed image's sentences: the part that holds it sends its fragments (GET /api/fragments),
which every part searches with (POST /api/fragments/sentences); an uploaded image likewise,
embedded by the first part that answers (POST /api/fragments): every part scores the same rows,
which parts embedding it each would round differently on other thread counts or CPUs (ties
across parts broken, a ranking of no one query); /images and /api/explain go to the image's
part. The front keeps the parts' /api/info, one connection pool, and the part of the last OWNERS
image names it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from defrag.cli import describe
from defrag.urls import redact
from trainer.search.web import (
    MAX_K,
    MIB,
    SPLIT_HEADER,
    STATIC,
    UPLOAD_READ_SECONDS,
    UPLOAD_WAIT_SECONDS,
    UploadSlots,
    answer_errors_in_one_line,
    image_url,
    refuse_by_headers,
    split_label,
)

log = logging.getLogger(__name__)

OWNERS = 4096  # image names whose part the front remembers (the most recently seen)
CONNECTIONS = 8  # the pool's connections per part (4 kept alive between requests)
STARTUP_WAIT = 60.0  # seconds the front waits for a part that is still starting
ANSWER_BYTES = 16 * MIB  # the most of a part's answer read (k <= MAX_K hits, an image's
# fragments, an explanation): a larger one is a missing part; image files are passed through
SEARCH_FIELDS = {"results": list, "exact": bool, "gap": (int, float), "scored": int}
REPLACED = ("answers for another index than the part checked when the front started (its "
            f"{SPLIT_HEADER} header): serve that part again, or restart the front")


@dataclass(frozen=True)
class Part:
    """One part of the split: its number, base URL and /api/info."""

    number: int
    url: str
    info: dict[str, Any]

    @property
    def shown(self) -> str:
        """The URL as logs and answers show it: a password in it masked."""
        return redact(self.url)

    @property
    def label(self) -> str | None:
        """The SPLIT_HEADER its answers must carry: the split and part checked at the start."""
        return split_label(self.info.get("split"))


@dataclass
class Answer:
    """What a part answered (its status, and JSON or bytes), or why it did not (`error`)."""

    part: Part
    status: int = 0  # 0: no answer
    body: Any = None
    media: str = ""
    error: str = ""  # why the part is missing from the merged answer; '' when it answered

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def refused(self) -> bool:
        """A 4xx with the API's {"error": line}: the input is bad (every part says so)."""
        return 400 <= self.status < 500 and isinstance(self.body, dict) and "error" in self.body


class PartClient:
    """The parts of a split index, asked concurrently, each within `timeout` seconds."""

    def __init__(self, parts: list[Part], timeout: float) -> None:
        self.parts, self.timeout = parts, timeout
        self.owners: OrderedDict[str, int] = OrderedDict()  # image name -> part, last seen last
        self.client: httpx.AsyncClient | None = None  # made in the app's event loop

    @classmethod
    def connect(cls, urls: list[str], timeout: float, wait: float = STARTUP_WAIT) -> PartClient:
        """Each part's /api/info (a part still starting is waited for `wait` seconds);
        ValueError unless they are all the parts of one split, in part order."""
        parts = [Part(number, url.strip().rstrip("/"), _info(url.strip().rstrip("/"), wait))
                 for number, url in enumerate(urls)]
        keys = {part.info["model_key"] for part in parts}
        if len(keys) > 1:
            raise ValueError(f"the parts were indexed with {len(keys)} different models: serve "
                             "the parts of one defrag index --parts")
        splits = [part.info.get("split", {"id": None, "part": 0, "parts": 1}) for part in parts]
        for part, split in zip(parts, splits, strict=True):
            if (split["part"], split["parts"]) != (part.number, len(parts)):
                raise ValueError(f"{part.shown} serves part {split['part']} of {split['parts']}, "
                                 f"not part {part.number} of the {len(parts)} given: list the "
                                 "URLs of every part of the split, in part order")
        if len({split["id"] for split in splits}) > 1:
            raise ValueError("the parts come from different merges (their split ids differ): "
                             "serve the parts of one defrag index --parts")
        return cls(parts, timeout)

    def total(self, key: str) -> int:
        return sum(part.info[key] for part in self.parts)

    async def ask(self, part: Part, method: str, path: str, **request: Any) -> Answer:
        """One request to one part, answered within the timeout in at most ANSWER_BYTES, or
        counted as missing."""
        assert self.client is not None
        try:
            async with asyncio.timeout(self.timeout), self.client.stream(
                    method, part.url + path, **request) as response:
                content = await read_at_most(response, ANSWER_BYTES)
        except (TimeoutError, httpx.TimeoutException):
            return Answer(part, error=f"timed out after {self.timeout:g} s")
        except httpx.TransportError as err:
            return Answer(part, error=f"failed: {describe(err)}")
        return answer_of(part, response, content)

    async def ask_all(self, method: str, path: str, **request: Any) -> list[Answer]:
        """The same request to every part at once; their answers in part order."""
        return list(await asyncio.gather(*(self.ask(part, method, path, **request)
                                           for part in self.parts)))

    async def first_ok(self, parts: list[Part], path: str, params: dict[str, str],
                       valid: Callable[[Any], bool]) -> tuple[Answer | None, list[Answer]]:
        """GET `path` of `parts` at once: the first answer that is not an error and whose body
        is `valid` (the others are then cancelled), or None; and the answers heard."""
        tasks = [asyncio.create_task(self.ask(part, "GET", path, params=params))
                 for part in parts]
        heard = []
        try:
            for next_one in asyncio.as_completed(tasks):
                heard.append(await next_one)
                if heard[-1].ok and not valid(heard[-1].body):
                    heard[-1].error = f"answered HTTP {heard[-1].status}, not {path}'s answer"
                if heard[-1].ok:
                    return heard[-1], heard
            return None, heard
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def refusal(self, answers: list[Answer], asked: str) -> HTTPException:
        """Why no part gave a result: the parts' refusal of the input when every part refused
        it (the one-part answer), else 503 naming the parts that did not answer."""
        if all(answer.refused for answer in answers):
            first = min(answers, key=lambda answer: answer.part.number)
            return HTTPException(first.status, first.body["error"])
        failed = sorted((answer for answer in answers if not answer.refused),
                        key=lambda answer: answer.part.number)
        self.report(failed, asked)
        return HTTPException(503, f"{len(failed)} of {len(self.parts)} parts of the split "
                                  "index did not answer: " + "; ".join(
                                      f"part {a.part.number} ({a.part.shown}) {a.error}"
                                      for a in failed))

    def report(self, missing: list[Answer], asked: str) -> list[dict[str, Any]]:
        """"missing_parts" of an answer, and one WARNING line when there are any."""
        if missing:
            log.warning("%s answered without %s", asked, "; ".join(
                f"part {a.part.number} ({a.part.shown}): {a.error}" for a in missing))
        return [{"part": a.part.number, "url": a.part.shown, "error": a.error} for a in missing]

    def merged(self, answers: list[Answer], k: int, item: Literal["image", "sentence"],
               asked: str) -> tuple[dict[str, Any], list[tuple[dict[str, Any], int]]]:
        """The best k of the parts' results (each names its `item`), each with its part (see
        the module doc), and their proof: exact when every part answered an exact top k; `gap`,
        the highest bound an inexact part left minus the k-th score; "missing_parts"."""
        for answer in answers:
            if answer.ok and not is_search(answer.body, item):
                answer.error = f"answered HTTP {answer.status}, not a search's answer"
        answered = [answer for answer in answers if answer.ok]
        if not answered:
            raise self.refusal(answers, asked)
        missing = [answer for answer in answers if not answer.ok]
        hits = sorted(((hit, answer.part.number) for answer in answered
                       for hit in answer.body["results"]),
                      key=lambda pair: -pair[0]["score"])[:k]  # stable: ties in part order
        exact = not missing and all(answer.body["exact"] for answer in answered)
        left = max((answer.body["gap"] + answer.body["results"][-1]["score"]
                    for answer in answered if not answer.body["exact"]
                    and answer.body["results"]), default=float("-inf"))
        low = hits[-1][0]["score"] if hits else 0.0
        return {"exact": exact, "gap": 0.0 if exact else max(left - low, 0.0),
                "scored": sum(answer.body["scored"] for answer in answered),
                "missing_parts": self.report(missing, asked)}, hits

    def remember(self, name: str, number: int) -> None:
        self.owners[name] = number
        self.owners.move_to_end(name)
        while len(self.owners) > OWNERS:
            self.owners.popitem(last=False)

    async def fragments_of(self, name: str) -> tuple[Part, list[list[float]]]:
        """The part that holds the indexed image `name` and its fragments: asked of the part
        remembered for it, else of every part; HTTPException when none can say (`refusal`)."""
        known = self.owners.get(name)
        found, heard = await self.first_ok(self.parts if known is None else [self.parts[known]],
                                           "/api/fragments", {"image": name},
                                           lambda body: isinstance(body, dict) and isinstance(
                                               body.get("fragments"), list))
        if found is None:
            raise self.refusal(heard, "/api/fragments")
        self.remember(name, found.part.number)
        return found.part, found.body["fragments"]

    async def embedded(self, body: bytes, media: str) -> list[list[float]]:
        """An uploaded image's fragments from the first part, in part order, that embeds it (a
        missing part is logged and the next asked); a part's refusal of the image is the
        answer (every part would refuse it); HTTPException when no part answered."""
        heard = []
        for part in self.parts:
            answer = await self.ask(part, "POST", "/api/fragments", content=body,
                                    headers={"content-type": media})
            if answer.ok and not (isinstance(answer.body, dict)
                                  and isinstance(answer.body.get("fragments"), list)):
                answer.error = f"answered HTTP {answer.status}, not /api/fragments' answer"
            if answer.ok or answer.refused:  # the image embedded, or bad
                self.report(heard, "POST /api/fragments")
                if answer.refused:
                    raise self.refusal([answer], "POST /api/fragments")
                return answer.body["fragments"]
            heard.append(answer)
        raise self.refusal(heard, "POST /api/fragments")

    async def sentences_for_rows(self, rows: list[list[float]], k: int,
                                 asked: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Every part's k best sentences for an image's fragment rows, merged: the proof and
        the results."""
        proof, hits = self.merged(await self.ask_all(
            "POST", "/api/fragments/sentences", params={"k": k}, json={"fragments": rows}),
            k, "sentence", asked)
        return proof, [{"rank": rank, "sentence": hit["sentence"], "score": hit["score"]}
                       for rank, (hit, _) in enumerate(hits, 1)]

    async def at_owner(self, name: str, path: str, params: dict[str, str]) -> Response:
        """GET `path` of the part that holds the indexed image `name`, its answer passed on."""
        part, _ = await self.fragments_of(name)
        answer = await self.ask(part, "GET", path, params=params)
        if answer.ok:
            return (Response(answer.body, media_type=answer.media)
                    if isinstance(answer.body, bytes) else JSONResponse(answer.body))
        raise self.refusal([answer], path)

    async def file_at_owner(self, name: str) -> Response:
        """The indexed image file `name` from its part, passed through a chunk at a time (never
        held whole: a file may be larger than ANSWER_BYTES)."""
        assert self.client is not None
        part, _ = await self.fragments_of(name)
        path = f"/images/{quote(name, safe='')}"
        try:
            async with asyncio.timeout(self.timeout):
                response = await self.client.send(self.client.build_request(
                    "GET", part.url + path), stream=True)
        except (TimeoutError, httpx.TimeoutException):
            raise self.refusal([Answer(part, error=f"timed out after {self.timeout:g} s")],
                               path) from None
        except httpx.TransportError as err:
            raise self.refusal([Answer(part, error=f"failed: {describe(err)}")], path) from None
        if response.status_code != 200 or response.headers.get(SPLIT_HEADER) != part.label:
            try:
                content = await read_at_most(response, ANSWER_BYTES)
            finally:
                await response.aclose()
            raise self.refusal([answer_of(part, response, content)], path)
        return StreamingResponse(response.aiter_raw(), media_type=response.headers.get(
            "content-type"), background=BackgroundTask(response.aclose))

    def app(self, max_upload_bytes: int, upload_slots: int) -> FastAPI:
        """The web app of the front: serve.py's page and API over the parts."""
        slots = UploadSlots(upload_slots, UPLOAD_WAIT_SECONDS, UPLOAD_READ_SECONDS)

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            """The connection pool, in the server's event loop, closed when it stops."""
            self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(
                max_connections=CONNECTIONS * len(self.parts),
                max_keepalive_connections=CONNECTIONS // 2 * len(self.parts)))
            async with self.client:
                yield
            slots.threads.shutdown(wait=True, cancel_futures=True)

        app = FastAPI(title="DeFrag search (a split index)", version="1", docs_url=None,
                      redoc_url=None, lifespan=lifespan,
                      description="The search API of an index split into parts, answered by "
                                  "asking each part (trainer/search/split.py).")
        answer_errors_in_one_line(app)
        self._add_searches(app)
        self._add_upload_search(app, max_upload_bytes, slots)
        self._add_at_owner(app)

        @app.get("/api/info", summary="The split index, its parts and its model")
        def info() -> dict[str, Any]:
            first = self.parts[0].info
            return {"model": first["model"], "model_key": first["model_key"],
                    "images": self.total("images"), "sentences": self.total("sentences"),
                    "max_query_chars": first["max_query_chars"],
                    "max_upload_bytes": max_upload_bytes, "max_k": MAX_K,
                    "max_image_pixels": first["max_image_pixels"],
                    "parts": [{"part": part.number, "url": part.shown,
                               "images": part.info["images"],
                               "sentences": part.info["sentences"]} for part in self.parts]}
        return app

    def _add_searches(self, app: FastAPI) -> None:
        """/api/search and /api/sentences?image=: every part asked, the answers merged."""

        @app.get("/api/search", summary="Sentence -> best images (every part)")
        async def search(q: str = Query(description="the sentence to search for"),
                         k: int = Query(10, ge=1, le=MAX_K, description="how many images")
                         ) -> dict[str, Any]:
            proof, hits = self.merged(await self.ask_all(
                "GET", "/api/search", params={"q": q, "k": k}), k, "image", "/api/search")
            for hit, number in hits:
                self.remember(hit["image"], number)
            return {"query": q, **proof, "results": [
                {"rank": rank, "image": hit["image"], "score": hit["score"],
                 "url": image_url(hit["image"])} for rank, (hit, _) in enumerate(hits, 1)]}

        @app.get("/api/sentences", summary="Indexed image -> best sentences (every part)")
        async def sentences_for_image(
                image: str = Query(description="an indexed image's file name"),
                k: int = Query(10, ge=1, le=MAX_K, description="how many sentences")
        ) -> dict[str, Any]:
            _, rows = await self.fragments_of(image)
            proof, results = await self.sentences_for_rows(rows, k, "/api/sentences")
            return {"image": image, "url": image_url(image), **proof, "results": results}

    def _add_upload_search(self, app: FastAPI, max_upload_bytes: int,
                           slots: UploadSlots) -> None:
        """POST /api/sentences: the upload read in one of the `slots` and embedded by one part
        (`embedded`), its fragments searched by every part, the answers merged."""

        @app.post("/api/sentences", summary="Uploaded image -> best sentences (every part)")
        async def sentences_for_upload(
                request: Request,
                k: int = Query(10, ge=1, le=MAX_K, description="how many sentences")
        ) -> dict[str, Any]:
            refuse_by_headers(request, max_upload_bytes)
            async with slots.taken():
                body = bytes(await slots.body(request, max_upload_bytes))
                rows = await self.embedded(body, request.headers["content-type"])
            proof, results = await self.sentences_for_rows(rows, k, "POST /api/sentences")
            return {"image": None, "bytes": len(body), **proof, "results": results}

    def _add_at_owner(self, app: FastAPI) -> None:
        """/api/explain and /images/NAME from the image's part; the page."""

        @app.get("/api/explain", summary="Why an image matches a sentence (its part's)")
        async def explain(q: str = Query(description="the sentence"),
                          image: str = Query(description="an indexed image's file name"),
                          format: Literal["png", "json"] = Query("png")) -> Response:
            return await self.at_owner(image, "/api/explain",
                                       {"q": q, "image": image, "format": format})

        @app.get("/images/{name}", summary="An indexed image file (its part's)")
        async def image_file(name: str) -> Response:
            try:
                return await self.file_at_owner(name)
            except HTTPException as err:  # an unknown name: 404, as the one-part index
                raise HTTPException(404 if err.status_code == 400 else err.status_code,
                                    err.detail) from err

        @app.get("/", include_in_schema=False)
        def page() -> FileResponse:
            return FileResponse(STATIC / "index.html")

        app.mount("/static", StaticFiles(directory=STATIC), name="static")


def answer_of(part: Part, response: httpx.Response, content: bytes | None) -> Answer:
    """A part's answer from its response and body (None: over ANSWER_BYTES): JSON parsed, an
    error unless 2xx; a 4xx {"error": line} kept as the part's refusal of the input."""
    if content is None:
        return Answer(part, response.status_code,
                      error=f"answered more than {ANSWER_BYTES / MIB:g} MiB")
    if response.headers.get(SPLIT_HEADER) != part.label:
        return Answer(part, response.status_code, error=REPLACED)
    media = response.headers.get("content-type", "")
    body: Any = content
    if media.startswith("application/json"):
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):
            return Answer(part, response.status_code, error="answered damaged JSON")
    answer = Answer(part, response.status_code, body, media)
    if answer.refused:
        answer.error = f"answered {answer.status}: {body['error']}"
    elif not 200 <= answer.status < 300:
        answer.error = f"answered HTTP {answer.status}"  # its text may name its disk
    return answer


async def read_at_most(response: httpx.Response, limit: int) -> bytes | None:
    """The body of a streamed response, or None once it is over `limit` bytes."""
    if int(response.headers.get("content-length") or 0) > limit:
        return None
    content = bytearray()
    async for chunk in response.aiter_bytes():
        content += chunk
        if len(content) > limit:
            return None
    return bytes(content)


def is_search(body: Any, item: str) -> bool:
    """Whether a part's body is a search's answer (serve.py's): its fields of their types, each
    result naming its `item` ("image" or "sentence") with a number as its score."""
    return (isinstance(body, dict)
            and all(isinstance(body.get(key), kind) for key, kind in SEARCH_FIELDS.items())
            and all(isinstance(hit, dict) and isinstance(hit.get("score"), (int, float))
                    and isinstance(hit.get(item), str) for hit in body["results"]))


def _info(url: str, wait: float) -> dict[str, Any]:
    """A part's /api/info, asked again for `wait` seconds while it refuses connections
    (starting); ValueError naming the URL when it does not answer one."""
    deadline = time.monotonic() + wait
    while True:
        try:
            response = httpx.get(f"{url}/api/info", timeout=10.0)
            response.raise_for_status()
            return response.json()
        except httpx.ConnectError as err:
            if time.monotonic() > deadline:
                raise ValueError(f"part {redact(url)} did not answer within {wait:g} s: "
                                 f"{describe(err)}") from err
            time.sleep(0.5)
        except (httpx.HTTPError, ValueError) as err:
            raise ValueError(f"{redact(url)}/api/info did not answer a search index's info: "
                             f"{describe(err)}") from err
