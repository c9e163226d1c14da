"""launch/slurm/train.sbatch across two nodes of a namespace cluster (tests/cluster.py), which
have what nodes of a real cluster have: an address and a host name each, their own /tmp, and
only a filesystem in common (the cluster's folder: shards, configs, run folders). Two nodes of
one process each give the losses of one node of two processes, step by step, bit for bit, and
its final weights (tests/test_remote_shards.py's assert_same_weights says why they can).

Then faults, each against that uninterrupted two-node run (`reference`): a node's processes
SIGKILLed mid-epoch (torchrun restarts them: the same losses and weights), its link cut (every
rank fails within run.collective_timeout naming the lost peer; a resubmission resumes), a slow
link (step times), and the rendezvous host gone before the start (one line). Each prints its
figures (`-s` shows them; launch/README.md records them).

Needs root, iproute2 and Debian's SLURM and munge; skipped without them, unless
DEFRAG_REQUIRE_CLUSTER=1. `make cluster-check` runs it; `make test` leaves it out.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from tests.cluster import (
    ENDED,
    ROOT,
    NamespaceCluster,
    cluster_ids,
    idle_nodes,
    ip,
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
from trainer.training.run_lock import LOCK

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def mlflow_run(run_dir: Path) -> tuple[str, list[Metric]]:
    """The status of the run's one MLflow run (its embedded store) and its `train/loss`
    history, as logged (each step once: a restart does not log again the steps it trains again)."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run.info.status, client.get_metric_history(run.info.run_id, "train/loss")


def losses(run_dir: Path) -> dict[int, float]:
    """The run's `train/loss` at every step."""
    return {m.step: m.value for m in mlflow_run(run_dir)[1]}


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


STEPS_PER_EPOCH = 10  # tiny_config on the `shards` fixture: 200 pairs, batches of 20


@pytest.fixture(scope="module")
def data(cluster: NamespaceCluster, shards: Path) -> Path:
    """The shards in the cluster's folder (pytest's folders are under /dev/shm or /tmp: no node
    sees them)."""
    copy = cluster.folder / "shards"
    shutil.copytree(shards, copy)
    return copy


@pytest.fixture(scope="module")
def env(cluster: NamespaceCluster, data: Path) -> dict[str, str]:
    """The environment of the jobs: CPU mode, one thread, each run's own MLflow store."""
    variables = {**cluster.env, "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": "0",
                 "SHARDS": str(data)}
    variables.pop("MLFLOW_TRACKING_URI", None)
    return variables


@pytest.fixture(scope="module")
def submit(env: dict[str, str]) -> Iterator[Callable[..., str]]:
    with jobs(env) as submit:
        yield submit


def train(submit: Callable[..., str], folder: Path, data: Path, *sbatch: str,
          overrides: tuple[str, ...] = (), **variables: object) -> str:
    """Submit train.sbatch on `folder`'s tiny config (a step logged each step), its output in
    `folder/job.out`: the job id. `variables` are the script's (RUN_DIR: `folder/run`)."""
    folder.mkdir(exist_ok=True)
    exports = {"CONFIG": tiny_config(folder, data), "RUN_DIR": folder / "run",
               "CPU_PROCS_PER_NODE": 1, **variables}
    return submit(*sbatch, f"--output={folder / 'job.out'}",
                  "--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items()),
                  str(ROOT / "launch/slurm/train.sbatch"), "run.log_every_steps=1", *overrides)


def ended(env: dict[str, str], job: str, folder: Path, seconds: float = 420) -> str:
    """The job's final state, once it has one; its output's tail in the assertion."""
    wait_for(lambda: job_field(env, job, "JobState") in ENDED, seconds, f"job {job}",
             folder / "job.out")
    return job_field(env, job, "JobState")


def output(folder: Path) -> str:
    return (folder / "job.out").read_text()[-4000:]


def saved_step(run_dir: Path) -> int:
    """The step of the checkpoint `latest` names (0 before the first)."""
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().split("-")[1]) if pointer.is_file() else 0


def mid_epoch(run_dir: Path, folder: Path) -> None:
    """Return once the checkpoint of step 4 is there (steps take ~0.05 s: polled every 0.02 s,
    so that the fault comes before the epoch's 10th step)."""
    deadline = time.monotonic() + 300
    while saved_step(run_dir) < 4:
        assert time.monotonic() < deadline, output(folder)
        time.sleep(0.02)


def ranks_on(cluster: NamespaceCluster, node: str) -> list[psutil.Process]:
    """The training processes torchrun started on `node` (not their loader processes)."""
    found = []
    for pid in ip("netns", "pids", cluster.netns(node), check=False).split():
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(int(pid))
            parent = process.parent()
            if "trainer.main" in process.cmdline() and parent and \
                    parent.cmdline()[1:2] and parent.cmdline()[1].endswith("torchrun"):
                found.append(process)
    return found


def step_seconds(history: list[Metric], steps: range) -> float:
    """The median time between the logs of consecutive steps in `steps`."""
    logged = {m.step: m.timestamp for m in history}
    return statistics.median((logged[s + 1] - logged[s]) / 1000 for s in steps[:-1])


@pytest.fixture(scope="module")
def reference(env: dict[str, str], submit: Callable[..., str], cluster: NamespaceCluster,
              data: Path) -> Path:
    """An uninterrupted run on 2 nodes x 1 process: its run folder."""
    folder = cluster.folder / "two-nodes"
    job = train(submit, folder, data, "--nodes=2")
    assert ended(env, job, folder) == "COMPLETED", output(folder)
    assert job_field(env, job, "NodeList") == "n[0-1]"
    return folder / "run"


@pytest.mark.timeout(900)
def test_two_nodes_give_the_one_node_losses(env, submit, cluster, data, reference) -> None:
    folder = cluster.folder / "one-node"
    job = train(submit, folder, data, "--nodes=1", CPU_PROCS_PER_NODE=2)
    assert ended(env, job, folder) == "COMPLETED", output(folder)
    one = folder / "run"
    steps = load_state(latest_checkpoint(one)).global_step
    assert sorted(losses(one)) == list(range(1, steps + 1))
    assert losses(reference) == losses(one)
    assert_same_weights(final_weights(reference), final_weights(one))


@pytest.mark.timeout(900)
def test_a_node_killed_mid_epoch_restarts_with_no_step_lost(env, submit, cluster, data,
                                                             reference) -> None:
    """Node n1's processes (its rank and that rank's loader processes) SIGKILLed mid-epoch, a
    step or two after the checkpoint of step 4: torchrun (MAX_RESTARTS=1) restarts both ranks
    from it, and the run ends with the uninterrupted run's steps, losses and weights, bit for
    bit. The steps between the checkpoint and the kill are trained again but not logged again:
    each step is in the history once."""
    folder = cluster.folder / "killed"
    job = train(submit, folder, data, "--nodes=2", MAX_RESTARTS=1,
                overrides=("run.checkpoint_every_steps=4",))
    run_dir = folder / "run"
    mid_epoch(run_dir, folder)
    time.sleep(0.15)  # a step or two past the checkpoint: steps to train again
    victims = [p for rank in ranks_on(cluster, "n1") for p in (rank, *rank.children())]
    assert victims, "no training process on n1"
    killed_at, saved = time.time(), saved_step(run_dir)
    for victim in victims:
        victim.kill()
    assert ended(env, job, folder) == "COMPLETED", output(folder)
    status, history = mlflow_run(run_dir)
    want = losses(reference)
    assert status == "FINISHED"
    assert sorted(m.step for m in history) == sorted(want)  # every step once, none beyond
    assert all(m.value == want[m.step] for m in history)
    assert load_state(latest_checkpoint(run_dir)).global_step == max(want)
    assert_same_weights(final_weights(reference), final_weights(run_dir))
    assert "resumed from" in (folder / "job.out").read_text()
    before = max(m.step for m in history if m.timestamp / 1000 <= killed_at)
    again = min(m.timestamp for m in history if m.timestamp / 1000 > killed_at) / 1000
    print(f"\nkilled after step {before} (checkpoint {saved}): the next step logged "
          f"{again - killed_at:.1f} s after the kill (restart, resume, {before - saved} "
          f"step(s) trained again, not logged again)")


COLLECTIVE_TIMEOUT = 20  # run.collective_timeout of the cut run, seconds


def ends(processes: list[psutil.Process], since: float, seconds: float) -> list[float | None]:
    """When each process ended (gone, or a zombie its parent has not reaped), in seconds after
    `since` (time.monotonic()), polled for up to `seconds`; None for one still running."""
    ended: list[float | None] = [None] * len(processes)
    deadline = time.monotonic() + seconds
    while None in ended and time.monotonic() < deadline:
        for i, process in enumerate(processes):
            with contextlib.suppress(psutil.NoSuchProcess):
                if ended[i] is None and process.status() != psutil.STATUS_ZOMBIE:
                    continue
            if ended[i] is None:
                ended[i] = time.monotonic() - since
        time.sleep(0.2)
    return ended


@pytest.mark.timeout(900)
def test_a_cut_link_fails_every_rank_in_the_timeout_then_a_resubmission_resumes(
        env, submit, cluster, data, reference) -> None:
    """n1's interface down mid-epoch (after the checkpoint of step 4): both ranks fail within
    run.collective_timeout (+ the 3 s probe of the peers), each in one line naming the other
    (rank 1's reaches the job's output once the link is back; torchrun's own report follows
    rank 0's, with its traceback, but none of the trainer's); n1's torchrun agent, blocked in
    a call to the rendezvous store on n0, stays until the link is back. The MLflow run is
    FAILED, the lock released, the checkpoint intact. With the link back, the job resubmitted
    on the same RUN_DIR resumes and ends with the uninterrupted run's losses and weights."""
    folder = cluster.folder / "cut"
    job = train(submit, folder, data, "--nodes=2",
                overrides=("run.checkpoint_every_steps=2",
                           f"run.collective_timeout={COLLECTIVE_TIMEOUT}"))
    run_dir = folder / "run"
    mid_epoch(run_dir, folder)
    ranks = ranks_on(cluster, "n0") + ranks_on(cluster, "n1")
    assert len(ranks) == 2
    agent = ranks[1].parent()
    cut_at = time.monotonic()
    ip("-n", cluster.netns("n1"), "link", "set", "eth0", "down")
    try:
        ended_after = ends(ranks, cut_at, COLLECTIVE_TIMEOUT + 30)
        agent_runs = agent.is_running() and agent.status() != psutil.STATUS_ZOMBIE
        wait_for(lambda: "error: rank 0" in output(folder), 30, "rank 0's line", folder / "job.out")
    finally:
        ip("-n", cluster.netns("n1"), "link", "set", "eth0", "up")
    back = time.monotonic() - cut_at
    assert ended(env, job, folder) == "FAILED", output(folder)
    print(f"\nlink cut -> rank 0 ended {ended_after[0]:.1f} s later, rank 1 (on the cut node) "
          f"{ended_after[1]:.1f} s; n1's torchrun agent "
          f"{'still ran' if agent_runs else 'had ended'} when the link came back "
          f"({back:.1f} s); run.collective_timeout={COLLECTIVE_TIMEOUT} s")
    for after in ended_after:
        assert after is not None and COLLECTIVE_TIMEOUT - 2 <= after <= COLLECTIVE_TIMEOUT + 15, \
            ended_after
    text = (folder / "job.out").read_text()
    [line] = [line for line in text.splitlines() if "error: rank 0" in line]
    assert f"lost rank 1 (n1, {cluster.nodes['n1']}: " in line, line
    log = folder / "job.out"  # rank 1's line may come before n1's torchrun's traceback
    wait_for(lambda: "error: rank 1" in log.read_text(), 30, "rank 1's line", log)
    [line] = [line for line in log.read_text().splitlines() if "error: rank 1" in line]
    assert f"lost rank 0 (n0, {cluster.nodes['n0']}: " in line, line
    assert f'File "{ROOT / "trainer"}' not in text  # no traceback through the trainer
    saved = saved_step(run_dir)
    assert load_state(latest_checkpoint(run_dir)).global_step == saved >= 4
    assert mlflow_run(run_dir)[0] == "FAILED" and not (run_dir / LOCK).exists()

    job = train(submit, folder, data, "--nodes=2")
    assert ended(env, job, folder) == "COMPLETED", output(folder)
    assert f"step {saved})" in (folder / "job.out").read_text()  # resumed from that checkpoint
    status, history = mlflow_run(run_dir)
    assert status == "FINISHED" and losses(run_dir) == losses(reference)
    assert_same_weights(final_weights(reference), final_weights(run_dir))


RATE = "10mbit"  # the slow link's, each way


def throttle(cluster: NamespaceCluster, node: str, on: bool) -> None:
    """`node`'s link limited to RATE each way (tc tbf on both ends of its veth pair), or not;
    this kernel has no netem, which would add delay instead."""
    shape = ("root", "tbf", "rate", RATE, "burst", "16kb", "latency", "1s") if on else ("root",)
    for prefix in ((), (tool("ip"), "netns", "exec", cluster.netns(node))):
        device = "eth0" if prefix else f"{cluster.bridge}-{node}"
        subprocess.run([*prefix, tool("tc"), "qdisc", "add" if on else "del", "dev", device,
                        *shape], check=on)


@pytest.mark.timeout(900)
def test_a_slow_link_step_time_and_the_all_gather_share(env, submit, cluster, data,
                                                        reference) -> None:
    """n1's link throttled: the step time of phase 1 (frozen CNN; one epoch: phase 2's
    all-reduce of the whole CNN's gradient would take seconds a step) against the fast link's
    (the reference's), and with the fragment all-gather off (run.global_negatives=false) on the
    same slow link: the difference is what the all-gather costs there."""
    runs = {}
    for name, gather in (("slow", "true"), ("slow-local", "false")):
        folder = cluster.folder / name
        throttle(cluster, "n1", on=True)
        try:
            job = train(submit, folder, data, "--nodes=2",
                        overrides=("optim.epochs=1", f"run.global_negatives={gather}"))
            assert ended(env, job, folder) == "COMPLETED", output(folder)
        finally:
            throttle(cluster, "n1", on=False)
        runs[name] = mlflow_run(folder / "run")[1]
    steps = range(2, STEPS_PER_EPOCH + 1)  # from the first step's log on
    fast = step_seconds(mlflow_run(reference)[1], steps)
    slow, local = (step_seconds(runs[name], steps) for name in ("slow", "slow-local"))
    print(f"\nphase-1 step: fast link {fast * 1000:.0f} ms, {RATE} link {slow * 1000:.0f} ms, "
          f"the same without the all-gather {local * 1000:.0f} ms: the all-gather "
          f"{(slow - local) * 1000:.0f} ms ({(slow - local) / slow:.0%} of the slow step)")
    assert slow > fast and slow > local


@pytest.mark.timeout(300)
def test_the_rendezvous_host_gone_before_the_start_is_one_line(env, submit, cluster,
                                                               data) -> None:
    """A job on n1 whose rendezvous host (RDZV_HOST=n0) has its link down: the node gives up
    after RDZV_WAIT s in one line, without torchrun's traceback."""
    folder, wait = cluster.folder / "no-rendezvous", 10
    ip("-n", cluster.netns("n0"), "link", "set", "eth0", "down")
    try:
        started = time.monotonic()
        job = train(submit, folder, data, "--nodes=1", "--nodelist=n1", RDZV_HOST="n0",
                    RDZV_WAIT=wait)
        state, took = ended(env, job, folder, 120), time.monotonic() - started
    finally:
        ip("-n", cluster.netns("n0"), "link", "set", "eth0", "up")
    text = (folder / "job.out").read_text()
    print(f"\nrendezvous host gone: the job failed {took:.1f} s after its submission "
          f"(RDZV_WAIT={wait} s)")
    assert state == "FAILED", text[-4000:]
    assert ("train.sbatch: n1 cannot reach the rendezvous host n0 (port " in text
            and f"in {wait} s: " in text), text[-4000:]
    assert "Traceback" not in text and took < wait + 30
