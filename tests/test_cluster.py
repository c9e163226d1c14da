"""launch/slurm/train.sbatch across two nodes of a namespace cluster (tests/cluster.py), which
have what nodes of a real cluster have: an address and a host name each, their own /tmp, and
only a filesystem in common (the cluster's folder: shards, configs, run folders). Two nodes of
one process each give the losses of one node of two processes, step by step, bit for bit, and
its final weights (tests/test_remote_shards.py's assert_same_weights says why they can).

Needs root, iproute2 and Debian's SLURM and munge; skipped without them, unless
DEFRAG_REQUIRE_CLUSTER=1. `make cluster-check` runs it; `make test` leaves it out.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.cluster import (
    ENDED,
    ROOT,
    NamespaceCluster,
    cluster_ids,
    idle_nodes,
    job_field,
    jobs,
    remove_leftovers,
    running,
    tool,
    wait_for,
)
from tests.test_remote_shards import assert_same_weights
from tests.test_train_e2e import final_weights, tiny_config
from trainer.training.checkpoint import latest_checkpoint, load_state

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def losses(run_dir: Path) -> dict[int, float]:
    """The run's `train/loss` at every step, from its embedded MLflow store."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


def on_every_node(cluster: NamespaceCluster, script: str) -> list[str]:
    """`sh -c script`'s output lines on every node (one srun task each), sorted."""
    done = subprocess.run([tool("srun"), f"--nodes={cluster.size}", "--ntasks-per-node=1",
                           "sh", "-c", script], env=cluster.env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return sorted(done.stdout.splitlines())


def test_each_node_has_its_own_name_address_routes_and_tmp(cluster: NamespaceCluster) -> None:
    """A file a node writes in /tmp is seen by no other node, nor by the host; a node's only
    route is the cluster's network (nothing it sends can leave the machine)."""
    on_every_node(cluster, "touch /tmp/defrag-$(hostname)")
    seen = on_every_node(cluster, "echo $(hostname) $(hostname -I) "
                                  "$(ip -4 route | cut -d' ' -f1) $(ls -d /tmp/defrag-*)")
    network = cluster.network.with_prefixlen
    assert seen == [f"{node} {address} {network} /tmp/defrag-{node}"
                    for node, address in cluster.nodes.items()]
    assert not [node for node in cluster.nodes if Path(f"/tmp/defrag-{node}").exists()]


def test_the_cluster_of_a_killed_owner_is_removed_and_a_live_one_kept(
        cluster: NamespaceCluster) -> None:
    """What a test killed with its one-node cluster up leaves (daemons, namespaces, links,
    folder) is removed by the next start (`remove_leftovers`); this session's cluster, whose
    owner runs, is left alone."""
    code = ("import os; from tests.cluster import NamespaceCluster; "
            "c = NamespaceCluster.new(1, os.getpid()); c.up(); print(c.ident, flush=True); "
            "os.kill(os.getpid(), 9)")
    killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    ident = killed.stdout.strip()
    assert killed.returncode == -9 and ident in cluster_ids(), killed.stderr
    left = NamespaceCluster.load(ident)
    assert left.namespaces() and all(map(running, left.daemons.values()))
    remove_leftovers()
    assert ident not in cluster_ids() and not any(map(running, left.daemons.values()))
    assert not left.namespaces() and not left.folder.exists()
    assert cluster.ident in cluster_ids() and idle_nodes(cluster.env) == cluster.size


@pytest.mark.timeout(900)
def test_two_nodes_give_the_one_node_losses(cluster: NamespaceCluster, shards: Path) -> None:
    data = cluster.folder / "shards"  # pytest's folders are under /tmp: no node sees them
    shutil.copytree(shards, data)
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "0", "SHARDS": str(data)}
    env.pop("MLFLOW_TRACKING_URI", None)  # each run's own store, in its run folder
    runs = {}
    with jobs(env) as submit:
        for name, nodes, processes in (("one-node", 1, 2), ("two-nodes", 2, 1)):
            folder = cluster.folder / name
            folder.mkdir()
            job = submit(f"--nodes={nodes}", f"--output={folder / 'job.out'}",
                         f"--export=ALL,CONFIG={tiny_config(folder, data)},"
                         f"RUN_DIR={folder / 'run'},CPU_PROCS_PER_NODE={processes}",
                         str(ROOT / "launch/slurm/train.sbatch"), "run.log_every_steps=1")
            runs[name] = job, folder
        for job, folder in runs.values():  # one after the other: both want node n0
            wait_for(lambda job=job: job_field(env, job, "JobState") in ENDED, 420,
                     f"job {job}", folder / "job.out")
    for job, folder in runs.values():
        output = (folder / "job.out").read_text()
        assert job_field(env, job, "JobState") == "COMPLETED", output[-4000:]
    assert job_field(env, runs["two-nodes"][0], "NodeList") == "n[0-1]"

    one, two = (folder / "run" for _, folder in runs.values())
    steps = load_state(latest_checkpoint(one)).global_step
    assert sorted(losses(one)) == list(range(1, steps + 1))
    assert losses(two) == losses(one)
    assert_same_weights(final_weights(two), final_weights(one))
