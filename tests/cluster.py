"""Real SLURM clusters on this machine for the tests: one node on the host itself
(tests/test_slurm.py's `slurm` fixture), or N nodes made of Linux namespaces (the `cluster`
fixture of tests/test_cluster.py, and launch/slurm/test_cluster.py for people).

A namespace node has what a real node has and processes on one host share: its own network
namespace and address, in 198.18.0.0/15 (RFC 2544's test range) with no default route, so that
nothing it sends leaves the machine; its own host name (a UTS namespace), which every node's
/etc/hosts resolves; its own /tmp and /dev/shm (tmpfs, in its mount namespace). The nodes hang
off a bridge in the host's namespace whose address is the controller's: slurmctld runs on the
host, like a login node's neighbour. The cluster's folder (under /var/tmp, not /tmp) is seen by
every node, as a shared filesystem; one munged there, with the cluster's own key and socket,
authenticates them all. Needs root, iproute2, util-linux and Debian's `slurmctld slurmd
slurm-client munge`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("munge", "unmunge", "sbatch", "scontrol", "scancel")
NAMESPACE_TOOLS = ("ip", "unshare", "nsenter", "hostname", "mount")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # a job's final states
INSTALL = ("as root: apt-get install --no-install-recommends slurmctld slurmd slurm-client "
           "munge")


def tool(name: str) -> str:
    return shutil.which(name, path=SEARCH_PATH) or name


def slurm_missing() -> str | None:
    """Why SLURM daemons cannot run here (missing programs, not root), or None."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=SEARCH_PATH) is None]
    return (f"missing {', '.join(missing)}; install them {INSTALL}" if missing
            else "the daemons need root" if os.geteuid() != 0 else None)


def namespaces_missing() -> str | None:
    """Why a namespace cluster cannot run here, or None."""
    missing = [name for name in NAMESPACE_TOOLS if shutil.which(name, path=SEARCH_PATH) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux, hostname)"
    if slurm_missing():
        return slurm_missing()
    if subprocess.run([tool("ip"), "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


def require(problem: str | None, what: str, variable: str) -> None:
    """Skip the test for `problem`, or fail when the environment `variable` is 1 (CI)."""
    if problem and os.environ.get(variable) == "1":
        pytest.fail(f"{what}: {problem} ({variable}=1)")
    if problem:
        pytest.skip(f"{what}: {problem}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(ready: Callable[[], bool], seconds: float, what: str,
             log: Path | None = None) -> None:
    """Poll `ready` until true; TimeoutError (with `log`'s tail) after `seconds`."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log and log.is_file() else ""
            raise TimeoutError(f"timed out after {seconds:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.5)


def scontrol(env: dict[str, str], *args: str) -> str:
    return subprocess.run([tool("scontrol"), *args], env=env, capture_output=True,
                          text=True).stdout


def idle_nodes(env: dict[str, str]) -> int:
    return scontrol(env, "show", "node", "-o").count("State=IDLE")


@contextmanager
def jobs(env: dict[str, str]) -> Iterator[Callable[..., str]]:
    """`submit(*sbatch_args)` -> the job id (`sbatch --parsable`, from the repository); every job
    submitted is cancelled at the end, whatever happened."""
    submitted: list[str] = []

    def submit(*argv: str) -> str:
        job = subprocess.run([tool("sbatch"), "--parsable", *argv], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        submitted.append(job.split(";")[0])
        return submitted[-1]

    try:
        yield submit
    finally:
        for job in submitted:
            subprocess.run([tool("scancel"), job], env=env, capture_output=True)


def job_field(env: dict[str, str], job: str, name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", scontrol(env, "show", "job", "-o", job))
    return match.group(1) if match else ""


def slurm_conf(folder: Path, controller: str, nodes: list[str], authinfo: str = "",
               select: str = "select/linear") -> str:
    """`nodes` (slurm.conf node lines) in one partition, slurmctld on `controller` (its host
    name, and its address in parentheses where that name does not resolve to it), state and
    logs in `folder` (each slurmd's under its node name, %n). `select`: whole nodes to a job
    (select/linear), or CPUs (select/cons_tres, CR_CPU: the tasks of an array share a node).

    A requeued job waits `cred_expire` (120 s by default) and then the next scheduling pass
    (every 60 s by default) before it starts again: both are shortened here, to SLURM's
    smallest (cred_expire: 5 s; a smaller value is refused for the default).
    """
    node_lines = "\n".join(f"{line} State=UNKNOWN" for line in nodes)
    return f"""\
ClusterName=defragci
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo={authinfo}cred_expire=5
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType={select}
{"SelectTypeParameters=CR_CPU" if select == "select/cons_tres" else ""}
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MailProg=/bin/true
ReturnToService=2
MinJobAge=3600
SlurmdParameters=config_overrides
{node_lines}
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def this_host() -> tuple[str, str]:
    """This host's short name, and its hardware as `slurmd -C` describes it (a node line)."""
    line = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]
    return socket.gethostname().split(".")[0], line


def munge_works(*socket_args: str) -> bool:
    credential = subprocess.run([tool("munge"), *socket_args, "-n"], capture_output=True)
    return credential.returncode == 0 and subprocess.run(
        [tool("unmunge"), *socket_args], input=credential.stdout,
        capture_output=True).returncode == 0


def start_munged(log: IO[str]) -> subprocess.Popen | None:
    """Reuse the host's running munged, else start it as the munge user (its key made if
    absent)."""
    if munge_works():
        return None
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").is_file():
        subprocess.run([tool("mungekey"), "--create"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
        os.chmod("/etc/munge/munge.key", 0o400)
    return subprocess.Popen([tool("munged"), "--foreground", "--force"], user="munge",
                            stdout=log, stderr=subprocess.STDOUT)


def stop(daemons: list[subprocess.Popen]) -> None:
    """SIGTERM each (last started first), SIGKILL one that has not exited 20 s later."""
    for daemon in reversed(daemons):
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def one_node(folder: Path) -> Iterator[dict[str, str]]:
    """This host as a one-node cluster: munged (unless one runs), slurmctld and slurmd in the
    foreground, state in `folder`; yields the environment for SLURM commands, then stops the
    daemons it started."""
    (folder / "state").mkdir()
    host, node = this_host()
    # the tasks of an array run side by side, one CPU each (train.sbatch asks --exclusive)
    (folder / "slurm.conf").write_text(slurm_conf(folder, host, [node],
                                                  select="select/cons_tres"))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    daemons: list[subprocess.Popen] = []
    with ExitStack() as logs:
        output = {name: logs.enter_context((folder / f"{name}.out").open("w"))
                  for name in ("munged", "slurmctld", "slurmd")}
        try:
            munged = start_munged(output["munged"])
            daemons += [munged] if munged else []
            wait_for(munge_works, 20, "munged to answer", folder / "munged.out")
            for name in ("slurmctld", "slurmd"):
                daemons.append(subprocess.Popen([tool(name), "-D"], env=env,
                                                stdout=output[name], stderr=subprocess.STDOUT))
            wait_for(lambda: idle_nodes(env) == 1, 60, "an idle node",
                     folder / f"slurmd-{host}.log")
            yield env
        finally:
            stop(daemons)


NETWORK = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: for tests, never routed outside
PREFIX = "defrag-"  # of every name a namespace cluster gives: namespaces, links, folders
HOME = Path("/var/tmp")  # the cluster's folder: seen by every node, unlike /tmp
NAMES = re.compile(rf"{PREFIX}(?:n\d+-|cluster-)?([0-9a-f]{{4}})(?:-n\d+)?")  # -> the cluster id
NODE = """\
hostname "$1"
mount --bind "$2/hosts" /etc/hosts
mount --bind "$2/resolv.conf" /etc/resolv.conf
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
exec "$3" -D -N "$1"
"""  # run by `sh -e` in a node's new UTS and mount namespaces: its name, the cluster's
# /etc/hosts and resolv.conf (no DNS server outside), its own /tmp and /dev/shm; slurmd


def ip(*args: str, check: bool = True) -> str:
    return subprocess.run([tool("ip"), *args], capture_output=True, text=True,
                          check=check).stdout


def record(pid: int) -> list:
    """A process as the cluster's state names it: pid and start time (against pid reuse)."""
    return [pid, psutil.Process(pid).create_time()]


def running(recorded: list | None) -> psutil.Process | None:
    """The recorded process, if it still runs."""
    try:
        process = psutil.Process(recorded[0]) if recorded else None
        if process and process.create_time() == recorded[1] and \
                process.status() != psutil.STATUS_ZOMBIE:
            return process
    except psutil.NoSuchProcess:
        pass
    return None


class NamespaceCluster:
    """Nodes n0, n1, ... (network namespaces `defrag-n<i>-<id>`, their ends of veth pairs
    `defrag-<id>-n<i>` on bridge `defrag-<id>`), state, config and logs in
    /var/tmp/defrag-cluster-<id>, which `new` creates and `down` removes."""

    def __init__(self, ident: str, size: int = 0, network: str = str(NETWORK),
                 owner: list | None = None, daemons: dict[str, list] | None = None) -> None:
        self.ident, self.size, self.network = ident, size, ipaddress.ip_network(network)
        self.owner = owner  # the process whose end leaves the cluster a leftover (else slurmctld)
        self.daemons = daemons or {}
        self.folder = HOME / f"defrag-cluster-{ident}"
        self.bridge = f"{PREFIX}{ident}"
        self.controller = str(self.network[1])  # the bridge's
        self.nodes = {f"n{i}": str(self.network[10 + i]) for i in range(size)}
        self.children: list[subprocess.Popen] = []

    @classmethod
    def new(cls, size: int, owner: int | None) -> NamespaceCluster:
        """A cluster's name, addresses and folder (nothing started yet), once the leftovers of
        clusters whose owner (`owner`: a pid, else their slurmctld) has ended are removed."""
        remove_leftovers()
        taken = cluster_ids()
        ident = next(i for i in iter(lambda: secrets.token_hex(2), None) if i not in taken)
        used = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
                for link in json.loads(ip("-j", "-4", "addr")) for a in link["addr_info"]]
        network = next(net for net in NETWORK.subnets(new_prefix=24)
                       if not any(net.overlaps(other) for other in used))
        cluster = cls(ident, size, str(network), record(owner) if owner else None)
        cluster.folder.mkdir()
        cluster.save()
        return cluster

    @classmethod
    def load(cls, ident: str) -> NamespaceCluster:
        """The cluster of that id as its state file says (a bare one without the file)."""
        state = HOME / f"defrag-cluster-{ident}" / "cluster.json"
        return cls(**json.loads(state.read_text())) if state.is_file() else cls(ident)

    def save(self) -> None:
        state = {"ident": self.ident, "size": self.size, "network": str(self.network),
                 "owner": self.owner, "daemons": self.daemons}
        (self.folder / "cluster.json.new").write_text(json.dumps(state))
        (self.folder / "cluster.json.new").replace(self.folder / "cluster.json")

    @property
    def env(self) -> dict[str, str]:
        """The environment of SLURM commands for this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def netns(self, node: str) -> str:
        return f"{PREFIX}{node}-{self.ident}"

    def live(self) -> bool:
        return running(self.owner or self.daemons.get("slurmctld")) is not None

    def up(self) -> None:
        """Network, munged, slurmctld and a slurmd per node; returns once every node is idle."""
        self.network_up()
        self.start_daemons()
        wait_for(lambda: idle_nodes(self.env) == self.size, 90, f"{self.size} idle nodes",
                 self.folder / "slurmctld.log")

    def network_up(self) -> None:
        prefix = f"/{self.network.prefixlen}"
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", self.controller + prefix, "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.nodes.items())
        (self.folder / "hosts").write_text(hosts)
        (self.folder / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        for node, address in self.nodes.items():
            netns, link = self.netns(node), f"{self.bridge}-{node}"
            ip("netns", "add", netns)
            ip("-n", netns, "link", "set", "lo", "up")
            ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", link, "master", self.bridge, "up")
            ip("-n", netns, "addr", "add", address + prefix, "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")

    def start_daemons(self) -> None:
        folder, munge_socket = self.folder, f"--socket={self.folder / 'munge.socket'}"
        subprocess.run([tool("mungekey"), "--create", f"--keyfile={folder / 'munge.key'}"],
                       check=True)
        self.start("munged", tool("munged"), "--foreground", "--force", munge_socket,
                   f"--key-file={folder / 'munge.key'}", f"--pid-file={folder / 'munged.pid'}",
                   f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}")
        wait_for(lambda: munge_works(munge_socket), 20, "munged to answer", folder / "munged.log")
        host, line = this_host()
        hardware = line.split(maxsplit=1)[1]  # CPUs=... RealMemory=...
        cpus = int(re.search(r"\bCPUs=(\d+)", hardware)[1])
        memory = re.search(r"RealMemory=\d+", hardware)[0]
        smaller = f"CPUs={cpus - 1} {memory}"
        nodes = [f"NodeName={n} NodeAddr={a} {hardware}" for n, a in self.nodes.items()]
        if len(nodes) > 1 and cpus > 1:  # the last node smaller, as in clusters of mixed nodes
            name, address = list(self.nodes.items())[-1]
            nodes[-1] = f"NodeName={name} NodeAddr={address} {smaller}"
        (folder / "state").mkdir()
        (folder / "slurm.conf").write_text(slurm_conf(
            folder, f"{host}({self.controller})", nodes, f"socket={folder / 'munge.socket'},"))
        self.start("slurmctld", tool("slurmctld"), "-D")
        for node in self.nodes:
            (folder / f"spool-{node}").mkdir()
            self.start(f"slurmd-{node}", tool("nsenter"), f"--net=/run/netns/{self.netns(node)}",
                       tool("unshare"), "--uts", "--mount", "sh", "-e", "-c", NODE, "sh", node,
                       str(folder), tool("slurmd"))

    def start(self, name: str, *argv: str) -> None:
        """Start a daemon in a session of its own (it outlives launch/slurm/test_cluster.py),
        its output in `<name>.out`, and record it."""
        with (self.folder / f"{name}.out").open("w") as output:
            self.children.append(subprocess.Popen(
                argv, env=self.env, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True))
        self.daemons[name] = record(self.children[-1].pid)
        self.save()

    def namespaces(self) -> list[str]:
        """This cluster's network namespaces that exist (whatever its state file says)."""
        names = (line.split()[0] for line in ip("netns", "list").splitlines())
        return [name for name in names if re.fullmatch(rf"{PREFIX}n\d+-{self.ident}", name)]

    def down(self, keep: Path | None = None) -> None:
        """Stop the daemons and every process in the nodes (jobs included), remove the
        namespaces, links, bridge and the folder (its logs and job outputs
        copied to `keep` first)."""
        processes = [p for p in map(running, self.daemons.values()) if p]
        for netns in self.namespaces():
            for pid in ip("netns", "pids", netns, check=False).split():
                with contextlib.suppress(psutil.NoSuchProcess):
                    processes.append(psutil.Process(int(pid)))
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=20)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        for child in self.children:
            child.wait()
        links = [link["ifname"] for link in json.loads(ip("-j", "link"))]
        for link in links:  # a veth pair goes whole, before its namespace (which takes time)
            if link.startswith(f"{self.bridge}-"):
                ip("link", "delete", link)
        for netns in self.namespaces():
            ip("netns", "delete", netns)
        if self.bridge in links:
            ip("link", "delete", self.bridge)
        if keep and self.folder.is_dir():
            for path in (*self.folder.rglob("*.log"), *self.folder.rglob("*.out")):
                (keep / path.relative_to(self.folder)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, keep / path.relative_to(self.folder))
        shutil.rmtree(self.folder, ignore_errors=True)


def cluster_ids() -> set[str]:
    """The ids of the namespace clusters on this machine, whole or left over, from the names of
    their namespaces, links and folders."""
    names = [line.split()[0] for line in ip("netns", "list").splitlines()]
    names += [link["ifname"] for link in json.loads(ip("-j", "link"))]
    names += [path.name for path in HOME.glob(PREFIX + "*")]
    return {match.group(1) for name in names if (match := NAMES.fullmatch(name))}


def remove_leftovers() -> None:
    """Remove the clusters whose owner (or slurmctld, without one) has ended."""
    for ident in cluster_ids():
        cluster = NamespaceCluster.load(ident)
        if not cluster.live():
            cluster.down()


def namespace_cluster(size: int, keep: Path) -> Iterator[NamespaceCluster]:
    """A cluster of `size` namespace nodes, owned by this process, up until the generator is
    closed (whatever happened); its logs and job outputs are then copied to `keep`."""
    cluster = NamespaceCluster.new(size, os.getpid())
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down(keep)
