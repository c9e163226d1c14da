"""A split index on the two nodes of a namespace cluster (tests/cluster.py), as a cluster runs it:
built by launch/slurm/index.sbatch (an array of 2 tasks, then the merge with --parts 2) and served
by launch/slurm/serve.sbatch (part P on node P at its own address, the front on the first node),
asked from the host. The front answers as the one-part index of the same collection built here
(tests/test_split_index.py's collection: twins across the parts); a part's process killed on
its node mid-query is named in "missing_parts" at once, and the other part's results still come.

Needs root, iproute2 and Debian's SLURM and munge (`make cluster-check`); `make test` leaves it
out.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

import trainer.search.index_builder as index_builder
import trainer.search.serve as serve
from tests.cluster import NamespaceCluster, ip, job_field, jobs, wait_for
from tests.search_world import SearchWorld, search_world, serving
from tests.test_arithmetic import one_thread
from tests.test_split_index import collection
from trainer.search.index import SearchIndex

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PART_PORT, FRONT_PORT = 8100, 8000  # on each node's own address
TIMEOUT = 3.0  # the front's --part-timeout


@pytest.fixture(scope="module")
def env(cluster: NamespaceCluster) -> dict[str, str]:
    """The jobs' environment: one thread (the one-part index here is built on one: the same
    rounding, so the same scores bit for bit), the ports and the front's timeout."""
    return {**cluster.env, "OMP_NUM_THREADS": "1", "PART_PORT": str(PART_PORT),
            "FRONT_PORT": str(FRONT_PORT), "PART_TIMEOUT": str(TIMEOUT)}


@pytest.fixture(scope="module")
def submit(env: dict[str, str]) -> Iterator[Callable[..., str]]:
    with jobs(env) as submit:
        yield submit


@pytest.fixture(scope="module")
def built(cluster: NamespaceCluster, env: dict[str, str], submit: Callable[..., str],
          tmp_path_factory: pytest.TempPathFactory) -> tuple[SearchWorld, Path, Path]:
    """The collection in the cluster's folder (the only one every node sees), its split index
    built by the array and the merge jobs, and its one-part index built here."""
    world = search_world(tmp_path_factory.getbasetemp() / "search-world")
    root = cluster.folder / "collection"
    root.mkdir()
    shutil.copytree(world.model_dir, root / "model")
    flags = collection(world, root)
    flags[flags.index("--model") + 1] = str(root / "model")
    array = submit("--array=0-1", f"--output={root / 'index-%a.out'}",
                   "launch/slurm/index.sbatch", *flags, "--out", str(root / "split"))
    merge = submit(f"--dependency=afterok:{array}", f"--output={root / 'merge.out'}",
                   "launch/slurm/index.sbatch", "--merge", "--out", str(root / "split"),
                   "--parts", "2")
    with one_thread():
        index_builder.main([*flags, "--out", str(root / "whole")])
    wait_for(lambda: job_field(env, merge, "JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
             300, "the split index's merge job", root / "merge.out")
    assert job_field(env, merge, "JobState") == "COMPLETED", (root / "merge.out").read_text()
    return world, root / "split", root / "whole"


@pytest.fixture(scope="module")
def front(cluster: NamespaceCluster, env: dict[str, str], submit: Callable[..., str],
          built: tuple[SearchWorld, Path, Path]) -> Iterator[tuple[str, Path]]:
    """serve.sbatch on both nodes: the front's URL (the first node's address) and the job's
    output."""
    _, split, _ = built
    out = split.parent / "serve.out"
    job = submit("--nodes=2", f"--output={out}", "launch/slurm/serve.sbatch", str(split))
    url = f"http://{cluster.nodes['n0']}:{FRONT_PORT}"

    def answers() -> bool:
        with contextlib.suppress(requests.ConnectionError):
            return requests.get(f"{url}/api/info", timeout=5).ok
        assert job_field(env, job, "JobState") in ("PENDING", "RUNNING"), out.read_text()
        return False

    wait_for(answers, 240, "the split index's front", out)
    yield url, out


@pytest.fixture(scope="module")
def whole(built: tuple[SearchWorld, Path, Path]) -> Iterator[str]:
    """The one-part index, served in this process."""
    with serving(serve.create_app(SearchIndex.open(built[2]), 10 * 2**20)) as url:
        yield url


def search(url: str, query: str, k: int) -> dict[str, Any]:
    answer = requests.get(f"{url}/api/search", params={"q": query, "k": k}, timeout=TIMEOUT + 30)
    assert answer.ok, answer.text
    return answer.json()


def part_processes(cluster: NamespaceCluster, node: str) -> list[psutil.Process]:
    """The processes serving a part on `node`: `defrag serve --index` and its workers."""
    found = []
    for pid in ip("netns", "pids", cluster.netns(node), check=False).split():
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(int(pid))
            if "serve" in process.cmdline() and "--index" in process.cmdline():
                found.append(process)
    assert len(found) == 1, found
    return [found[0], *found[0].children(recursive=True)]


@pytest.mark.timeout(900)
def test_the_front_on_the_cluster_answers_as_the_one_part_index_until_a_part_dies(
        cluster: NamespaceCluster, built: tuple[SearchWorld, Path, Path],
        front: tuple[str, Path], whole: str) -> None:
    world, split, _ = built
    url, out = front
    info = requests.get(f"{url}/api/info", timeout=10).json()
    assert [part["url"] for part in info["parts"]] == [f"http://n{p}:{PART_PORT}" for p in (0, 1)]
    assert (info["images"], info["sentences"]) == (10, 42)
    queries = [world.query, *(cs[1] for cs in list(world.captions.values())[:3])]
    for query in queries:
        for k in (1, 3, 10):
            split_answer, one_part = search(url, query, k), search(whole, query, k)
            assert split_answer.pop("missing_parts") == [] and split_answer["exact"] is True
            assert split_answer.pop("scored") >= 1 and one_part.pop("scored") >= 1
            assert split_answer == one_part, query

    killed = part_processes(cluster, "n1")  # part 1 holds the second half of the images
    second_half = set(json.loads((split / "part-1" / "index.json").read_text())["images"])
    for process in killed:
        process.send_signal(signal.SIGSTOP)  # the query waits on the part ...
    answers: list[dict[str, Any]] = []
    asking = threading.Thread(target=lambda: answers.append(search(url, world.query, 5)))
    started = time.monotonic()
    asking.start()
    time.sleep(TIMEOUT / 3)
    for process in killed:
        process.kill()  # ... and its connection is reset
    asking.join()
    took = time.monotonic() - started
    assert took < TIMEOUT, took
    after = search(url, world.query, 5)
    for answer in (*answers, after):
        assert answer["exact"] is False, answer
        assert [(m["part"], m["url"]) for m in answer["missing_parts"]] == [
            (1, f"http://n1:{PART_PORT}")]
        assert answer["results"] and not {hit["image"] for hit in answer["results"]} & second_half
    print(f"\nsplit index on the cluster: part 1 killed mid-query, answered in {took:.2f} s "
          f"(part timeout {TIMEOUT:g} s): {answers[0]['missing_parts']}")
    log = out.read_text()
    assert f"part 1 (http://n1:{PART_PORT})" in log and log.count("WARNING ") >= 2
