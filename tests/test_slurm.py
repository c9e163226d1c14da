"""launch/slurm/train.sbatch on a real one-node SLURM cluster started on localhost (CPU mode).

The job is asked to stop mid-run the way SLURM does it before the time limit (SIGUSR1 to the
batch shell, `--signal=B:USR1@120`), or by SIGTERM to every process of its training step
(`scancel --signal=TERM`): it checkpoints, requeues itself, resumes from the checkpoint and
completes with a best model and one finished MLflow run.

Needs root and Debian's `slurmctld slurmd slurm-client munge` (no systemd or cgroups:
proctrack/linuxproc, task/none). Without them the test is skipped, unless DEFRAG_REQUIRE_SLURM=1
(set by .ci/run) turns the skip into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import pytest
from mlflow import MlflowClient

from tests.test_train_e2e import tiny_config
from trainer.store.model_folder import ModelFolder
from trainer.training.checkpoint import latest_checkpoint, load_state

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("munge", "unmunge", "sbatch", "scontrol", "scancel")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # a job's final states
INSTALL = ("as root: apt-get install --no-install-recommends slurmctld slurmd slurm-client "
           "munge")


def tool(name: str) -> str:
    return shutil.which(name, path=SEARCH_PATH) or name


def require_slurm() -> None:
    """Skip (fail under DEFRAG_REQUIRE_SLURM=1) without the SLURM and munge programs or root."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=SEARCH_PATH) is None]
    problem = (f"SLURM test: missing {', '.join(missing)}; install them {INSTALL}" if missing
               else "SLURM test: the daemons need root" if os.geteuid() != 0 else None)
    if problem and os.environ.get("DEFRAG_REQUIRE_SLURM") == "1":
        pytest.fail(problem + " (DEFRAG_REQUIRE_SLURM=1)")
    if problem:
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def munge_works() -> bool:
    credential = subprocess.run([tool("munge"), "-n"], capture_output=True)
    return credential.returncode == 0 and subprocess.run(
        [tool("unmunge")], input=credential.stdout, capture_output=True).returncode == 0


def start_munged(log: IO[str]) -> subprocess.Popen | None:
    """Reuse a running munged, else start one as the munge user (its key made if absent)."""
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


def slurm_conf(folder: Path) -> str:
    """One node (this host, as `slurmd -C` describes it), one partition, state in `folder`.

    A requeued job waits `cred_expire` (120 s by default) and then the next scheduling pass
    (every 60 s by default) before it starts again: both are shortened here, to SLURM's
    smallest (cred_expire: 5 s; a smaller value is refused for the default).
    """
    node = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]
    host = socket.gethostname().split(".")[0]
    return f"""\
ClusterName=defragci
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MailProg=/bin/true
AuthInfo=cred_expire=5
ReturnToService=2
MinJobAge=3600
SlurmdParameters=config_overrides
{node} State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def wait_for(ready, seconds: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log and log.is_file() else ""
            pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.5)


def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """munged (unless one runs), slurmctld and slurmd in the foreground; yields the environment
    for SLURM commands, then stops the daemons it started, by their PIDs. tests/conftest.py's
    `slurm` fixture runs it once for the session."""
    require_slurm()
    folder = tmp_path_factory.mktemp("slurm")
    for name in ("state", "spool"):
        (folder / name).mkdir()
    (folder / "slurm.conf").write_text(slurm_conf(folder))
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
            wait_for(lambda: "State=IDLE" in scontrol(env, "show", "node"), 60,
                     "an idle node", folder / "slurmd.log")
            yield env
        finally:
            for daemon in reversed(daemons):
                daemon.terminate()
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()


def scontrol(env: dict[str, str], *args: str) -> str:
    return subprocess.run([tool("scontrol"), *args], env=env, capture_output=True,
                          text=True).stdout


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


@pytest.mark.parametrize("signal", ["USR1", "TERM"])
def test_job_stopped_by_signal_requeues_resumes_and_completes(slurm, tmp_path, shards, signal):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri).create_experiment(
        "defrag", artifact_location=(tmp_path / "artifacts").as_uri())
    env = {**slurm, "CONFIG": str(tiny_config(tmp_path, shards)), "SHARDS": str(shards),
           "RUN_DIR": str(run_dir), "GPUS_PER_NODE": "0", "CPU_PROCS_PER_NODE": "2",
           "MLFLOW_TRACKING_URI": tracking_uri}
    job = subprocess.run([tool("sbatch"), "--parsable", f"--output={log}",
                          str(ROOT / "launch/slurm/train.sbatch"), "run.log_every_steps=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job_id = job.stdout.strip().split(";")[0]
    try:
        # The first attempt has set its trap once it prints its start line; the request is
        # then seen at its first training step.
        wait_for(lambda: log.is_file() and "(restart 0)" in log.read_text(), 120,
                 "the job to start", log)
        if signal == "USR1":  # to the batch shell, which asks the trainer to stop
            subprocess.run([tool("scancel"), "--batch", "--signal=USR1", job_id], env=env,
                           check=True)
        else:  # to torchrun and its workers, once these catch it (the training has started)
            wait_for(lambda: "epoch 0: phase" in log.read_text(), 300, "the training", log)
            subprocess.run([tool("scancel"), "--signal=TERM", job_id], env=env, check=True)
        wait_for(lambda: job_field(slurm, job_id, "JobState") in ENDED, 300, "the job to end",
                 log)
    finally:
        subprocess.run([tool("scancel"), job_id], env=env, capture_output=True)
    output = log.read_text()
    assert job_field(slurm, job_id, "JobState") == "COMPLETED", output[-4000:]
    assert job_field(slurm, job_id, "Restarts") == "1", output[-4000:]
    assert "requeueing the job" in output and "(restart 1)" in output, output[-4000:]
    assert "resumed from" in output, output[-4000:]

    state = load_state(latest_checkpoint(run_dir))
    assert state.epoch == 2
    ModelFolder.open(run_dir / "best")
    client = MlflowClient(tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("defrag").experiment_id])
    assert run.info.status == "FINISHED"  # the requeued job resumed the same run
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, state.global_step + 1))  # none lost or repeated at the stop
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2
    assert client.get_model_version_by_alias("defrag", "champion").run_id == run.info.run_id
