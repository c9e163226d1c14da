"""A SLURM cluster of N nodes made of Linux namespaces on this machine (tests/cluster.py, the one
`make cluster-check` runs on), to try launch/slurm/train.sbatch across nodes without a cluster:

    .venv/bin/python launch/slurm/test_cluster.py up [--nodes 2]   # prints how to submit to it
    .venv/bin/python launch/slurm/test_cluster.py status
    .venv/bin/python launch/slurm/test_cluster.py down

As root, with iproute2 and Debian's `slurmctld slurmd slurm-client munge`. `down` removes every
such cluster (daemons, jobs, namespaces, links, folder) but one a running test owns.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.cluster import (  # noqa: E402 (the repository on the path first)
    NamespaceCluster,
    cluster_ids,
    namespaces_missing,
    scontrol,
)

SCRIPT = "launch/slurm/test_cluster.py"


def usage(cluster: NamespaceCluster) -> str:
    """How to submit to the cluster and look into it."""
    nodes = ", ".join(f"{name} ({address})" for name, address in cluster.nodes.items())
    slurmd = cluster.daemons["slurmd-n0"][0]
    return f"""\
cluster {cluster.ident}: nodes {nodes}, slurmctld on this host at {cluster.controller}
Every node sees this machine's files, but for /tmp and /dev/shm, its own: keep shards and run
folders out of /tmp (in the repository, or in {cluster.folder}, which `down` removes).
Submit from the repository, e.g. the demo's training on 2 nodes of 1 process each:
  export SLURM_CONF={cluster.folder}/slurm.conf
  .venv/bin/defrag featurize synthetic --out runs/cluster-demo/data --shard-size 100
  CONFIG=launch/configs/demo.yaml SHARDS=runs/cluster-demo/data RUN_DIR=runs/cluster-demo/run \\
      CPU_PROCS_PER_NODE=1 sbatch --nodes {cluster.size} launch/slurm/train.sbatch
  squeue; sinfo -N       # the job's output: defrag-<job id>.out in the repository
A shell on node n0: nsenter --target {slurmd} --net --mount --uts bash
Remove it: .venv/bin/python {SCRIPT} down"""


def status() -> None:
    for ident in sorted(cluster_ids()):
        cluster = NamespaceCluster.load(ident)
        owner = f"test pid {cluster.owner[0]}" if cluster.owner else SCRIPT
        if not cluster.live():
            print(f"cluster {ident}: left over (its {owner} has ended); `down` removes it")
            continue
        print(usage(cluster) if not cluster.owner else f"cluster {ident}: run by {owner}")
        nodes = re.findall(r"NodeName=(\S+) .*State=(\S+)",
                           scontrol(cluster.env, "show", "node", "-o"))
        print("nodes:", ", ".join(map(" ".join, nodes)) or "slurmctld does not answer")


def down() -> None:
    for ident in sorted(cluster_ids()):
        cluster = NamespaceCluster.load(ident)
        if cluster.owner and cluster.live():
            print(f"cluster {ident}: left alone, test pid {cluster.owner[0]} runs it")
            continue
        cluster.down()
        print(f"cluster {ident}: removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "status", "down"])
    parser.add_argument("--nodes", type=int, default=2, help="nodes of a new cluster (up)")
    args = parser.parse_args()
    if problem := namespaces_missing():
        sys.exit(f"{SCRIPT}: {problem}")
    if args.action == "status":
        status()
    elif args.action == "down":
        down()
    else:
        cluster = NamespaceCluster.new(args.nodes, owner=None)
        try:
            cluster.up()
        except BaseException:
            cluster.down()
            raise
        print(usage(cluster))


if __name__ == "__main__":
    main()
