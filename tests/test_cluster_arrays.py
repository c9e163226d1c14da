"""The featurize and index job arrays of launch/slurm/ across the two nodes of a namespace cluster
(tests/cluster.py): each array task on a node of its own (a whole node each, `--exclusive`),
reading its inputs from and writing its parts to the cluster's folder, the only filesystem the
nodes share; the merge job, on either node, then writes what one process writes from the same
inputs (tests/test_featurize_at_scale.py and tests/test_index_build.py check the same on one
node). Each test prints which node ran which task (`-s` shows it).

Needs root, iproute2 and Debian's SLURM and munge; skipped without them, unless
DEFRAG_REQUIRE_CLUSTER=1. `make cluster-check` runs it; `make test` leaves it out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import ENDED, ROOT, NamespaceCluster, idle_nodes, job_field, jobs, wait_for
from tests.test_featurize_at_scale import (
    FLAGS,
    INPUTS,
    folder_files,
    inputs,  # noqa: F401 (a fixture)
    without_created_by,
)
from tests.test_index_build import (
    Collection,
    assert_same_index,
    collection,  # noqa: F401 (a fixture)
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

ACROSS = ("--array=0-1", "--nodes=1", "--exclusive")  # 2 tasks, each a whole node of the 2


@pytest.fixture(scope="module")
def env(cluster: NamespaceCluster) -> dict[str, str]:
    """The jobs' environment: one thread each, as the one-process references run."""
    return {**cluster.env, "OMP_NUM_THREADS": "1"}


def one_process(module: str, *argv: str | Path) -> subprocess.Popen:
    """`python -m module ARGV` on this host (one thread), running beside the jobs."""
    return subprocess.Popen([sys.executable, "-m", module, *map(str, argv)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finished(reference: subprocess.Popen) -> None:
    output, _ = reference.communicate(timeout=240)
    assert reference.returncode == 0, output[-4000:]


def array_then_merge(env: dict[str, str], folder: Path, script: str, task_args: list[str],
                     merge_args: list[str]) -> list[str]:
    """`script TASK_ARGS` as a 2-task array on the 2 idle nodes, then `script MERGE_ARGS` once
    both succeeded (afterok); outputs in `folder` (task-<i>.out, merge.out). The node of each
    task, once the merge has completed."""
    folder.mkdir()
    wait_for(lambda: idle_nodes(env) == 2, 60, "2 idle nodes")
    started = time.monotonic()
    with jobs(env) as sbatch:
        array = sbatch(*ACROSS, f"--output={folder}/task-%a.out", script, *task_args)
        merge = sbatch(f"--dependency=afterok:{array}", f"--output={folder}/merge.out", script,
                       *merge_args)
        tasks = [f"{array}_{task}" for task in (0, 1)]
        wait_for(lambda: job_field(env, merge, "JobState") in ENDED or any(
            job_field(env, task, "JobState") in ENDED - {"COMPLETED"} for task in tasks),
            240, "the merge job (or a failed task)", folder / "merge.out")
    logs = "".join(f"{path.name}:\n{path.read_text()}" for path in sorted(folder.glob("*.out")))
    assert job_field(env, merge, "JobState") == "COMPLETED", logs[-6000:]
    nodes = [job_field(env, task, "NodeList") for task in tasks]
    for task, node in enumerate(nodes):
        assert f"on {node}: array task {task} of 2:" in (folder / f"task-{task}.out").read_text()
    print(f"\n{Path(script).name}: task 0 on {nodes[0]}, task 1 on {nodes[1]}, the merge on "
          f"{job_field(env, merge, 'NodeList')}; {time.monotonic() - started:.0f} s from the "
          "submission to the merge's end")
    assert sorted(nodes) == ["n0", "n1"]
    return nodes


def test_a_featurize_array_across_nodes_writes_what_one_process_does(
        env: dict[str, str], cluster: NamespaceCluster, inputs: Path,  # noqa: F811
        tmp_path: Path) -> None:
    """4 img2dataset shards in the cluster's folder, 2 per task, into a folder there: the same
    shard, part and vocabulary bytes, the same manifest but for its `created_by`, as one
    process writing another folder from them."""
    shards = cluster.folder / "img2dataset"
    shutil.copytree(inputs, shards)
    out, local = cluster.folder / "featurized", tmp_path / "local"
    flags = ["--shards", str(shards / INPUTS), *FLAGS]
    reference = one_process("featurizer", "webdataset", *flags, "--out", local)
    try:
        array_then_merge(env, cluster.folder / "featurize-jobs",
                         str(ROOT / "launch/slurm/featurize.sbatch"), [*flags, "--out", str(out)],
                         ["merge", "--out", str(out)])
    finally:
        finished(reference)
    for task in (0, 1):
        assert (f"task {task} of 2: 2 of 4 input shards, 0 finished before, 2 written (12 "
                "images, 0 inputs skipped)") in (
            cluster.folder / f"featurize-jobs/task-{task}.out").read_text()
    ours, theirs = folder_files(out), folder_files(local)
    assert sorted(ours) == sorted(theirs)
    assert {"train/shard-000000.tar", "val/shard-000003.tar", "parts/000001.json"} <= set(ours)
    for name in theirs.keys() - {"manifest.json", "parts/plan.json"}:  # these two name --out
        assert ours[name] == theirs[name], name
    assert without_created_by(ours["manifest.json"]) == without_created_by(
        theirs["manifest.json"])


def test_an_index_array_across_nodes_builds_what_one_process_does(
        env: dict[str, str], cluster: NamespaceCluster,
        collection: Collection, tmp_path: Path) -> None:  # noqa: F811
    """The val split of test_index_build's collection (4 shards: 2 units a task) and its model
    in the cluster's folder, indexed there: the same bytes as one process's build of them."""
    root = cluster.folder / "collection"
    for name in ("model", "shards"):
        shutil.copytree(getattr(collection, name), root / name)
    source = ["--model", str(root / "model"), "--shards", str(root / "shards"), "--split", "val",
              "--workers", "1"]
    out, whole = cluster.folder / "index", tmp_path / "index"
    reference = one_process("trainer.search.index_builder", *source, "--out", whole)
    try:
        array_then_merge(env, cluster.folder / "index-jobs",
                         str(ROOT / "launch/slurm/index.sbatch"), [*source, "--out", str(out)],
                         ["--merge", "--out", str(out)])
    finally:
        finished(reference)
    for task in (0, 1):
        output = (cluster.folder / f"index-jobs/task-{task}.out").read_text()
        summary = json.loads(output.splitlines()[-1])
        assert (summary["task"], summary["tasks"], summary["units"]) == (task, 2, 2)
    assert_same_index(out, whole)
