"""The run_dir lock (trainer/training/run_lock.py): a second run on a run_dir in use is refused in
one line naming the holder while the first finishes untouched; a lock whose holder is gone (a dead
process here, a stopped heartbeat on another node, this job's own earlier process) is taken over
(by a rank 0 restarted under `torchrun --max-restarts`: tests/test_train_e2e.py's kill test); a
run_dir the run cannot write fails at once, naming it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mlflow import MlflowClient

from defrag.cli import describe
from tests.small_training import small_config
from tests.test_cli_errors import TRAIN, error_lines, run_cli
from tests.test_train_e2e import tiny_config
from trainer.training.distributed import DistContext, end_process
from trainer.training.preemption import DONE, RunDirLost, stop_on_sigterm, stop_requested
from trainer.training.run_lock import (
    LOCK,
    OWN_JOB_STALE_SECONDS,
    STALE_SECONDS,
    Holder,
    RunDirInUse,
    RunDirLock,
    RunDirUnwritable,
    _start_time,
    run_dir_locked,
)

ROOT = Path(__file__).resolve().parents[1]
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
IN_USE = (r"run_dir {} is in use by host \S+ pid {} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC "
          r"\(its lock file {}, refreshed \d+ s ago\); wait for it or use another run.run_dir")


def write_lock(run_dir: Path, heartbeat_age: float = 0.0, **fields: object) -> Path:
    """LOCK as the holder `fields` describe (the rest: this process) left it, its heartbeat
    `heartbeat_age` seconds old."""
    run_dir.mkdir(exist_ok=True)
    holder = dataclasses.replace(Holder.me(), **fields)
    path = run_dir / LOCK
    path.write_text(json.dumps(dataclasses.asdict(holder)))
    beat = time.time() - heartbeat_age
    os.utime(path, (beat, beat))
    return path


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys; "
         "from trainer.training.run_lock import RunDirLock; "
         "RunDirLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)",
         str(run_dir)], cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    dead = json.loads((run_dir / LOCK).read_text())
    lock = RunDirLock(run_dir)
    with caplog.at_level(logging.WARNING, logger="trainer.training.run_lock"):
        lock.acquire()
    assert f"taking over the lock of host {dead['host']} pid {dead['pid']}" in caplog.text
    assert "that process no longer runs" in caplog.text
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == []  # nothing left behind


def test_a_reused_pid_does_not_keep_a_dead_holder_alive(tmp_path):
    """A restarted container's new process may get the dead one's pid: the start time tells."""
    write_lock(tmp_path, pid=os.getpid(), started="1")
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.release()


def test_a_killed_process_not_yet_reaped_counts_as_gone(tmp_path):
    zombie = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(tmp_path, pid=zombie.pid, started=_start_time(zombie.pid))
        os.kill(zombie.pid, signal.SIGKILL)
        while Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1][0] != "Z":
            time.sleep(0.01)
        lock = RunDirLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        zombie.wait()


def test_a_live_process_on_this_machine_keeps_its_lock(tmp_path):
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(tmp_path, heartbeat_age=10 * STALE_SECONDS, pid=holder.pid,
                   started=_start_time(holder.pid))
        with pytest.raises(RunDirInUse, match=IN_USE.format(tmp_path, holder.pid,
                                                            tmp_path / LOCK)):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_another_nodes_lock_is_kept_while_its_heartbeat_is_fresh(tmp_path, caplog):
    path = write_lock(tmp_path, heartbeat_age=STALE_SECONDS - 30, host="node-7",
                      machine="another-node", pid=4242)
    with pytest.raises(RunDirInUse, match=IN_USE.format(tmp_path, 4242, path)):
        RunDirLock(tmp_path).acquire()
    assert json.loads(path.read_text())["host"] == "node-7"

    write_lock(tmp_path, heartbeat_age=STALE_SECONDS + 30, host="node-7",
               machine="another-node", pid=4242)
    lock = RunDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trainer.training.run_lock"):
        lock.acquire()
    assert "taking over the lock of host node-7 pid 4242" in caplog.text
    assert "no heartbeat for" in caplog.text
    lock.release()


def test_this_jobs_earlier_rank_zero_is_taken_over_once_its_heartbeat_stopped(tmp_path,
                                                                               monkeypatch):
    """A torchrun restart or a SLURM requeue (same torchrun run id) whose rank 0 now runs on
    another node than the dead one: no need to wait STALE_SECONDS."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4711")
    stopped = OWN_JOB_STALE_SECONDS + 10
    write_lock(tmp_path, heartbeat_age=stopped, machine="another-node", job="4712")
    with pytest.raises(RunDirInUse):  # another job's
        RunDirLock(tmp_path).acquire()
    write_lock(tmp_path, heartbeat_age=OWN_JOB_STALE_SECONDS - 10, machine="another-node",
               job="4711")
    with pytest.raises(RunDirInUse):  # this job's, still beating
        RunDirLock(tmp_path).acquire()
    write_lock(tmp_path, heartbeat_age=stopped, machine="another-node", job="4711")
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.release()


def test_the_holder_refreshes_its_heartbeat_and_releases_only_its_own_lock(tmp_path):
    lock = RunDirLock(tmp_path, heartbeat_seconds=0.05)
    lock.acquire()
    path = tmp_path / LOCK
    old = time.time() - 1000
    os.utime(path, (old, old))
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 5
    lock.release()
    assert not path.exists()

    lock = RunDirLock(tmp_path)
    lock.acquire()
    write_lock(tmp_path, machine="another-node", host="node-7")  # replaced by hand meanwhile
    lock.release()
    assert json.loads(path.read_text())["host"] == "node-7"


@pytest.fixture
def read_only_folder(tmp_path: Path):
    """A folder nobody can write: mode 555, or as root (whom modes do not stop) a read-only
    tmpfs; a root that cannot mount skips, unless DEFRAG_REQUIRE_MOUNT=1 (CI) fails."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        problem = f"cannot mount a read-only tmpfs ({mounted.stderr.strip()})"
        if os.environ.get("DEFRAG_REQUIRE_MOUNT") == "1":
            pytest.fail(f"{problem} (DEFRAG_REQUIRE_MOUNT=1)")
        pytest.skip(problem)
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_run_dir_fails_at_once_naming_it(tmp_path, shards, read_only_folder):
    config = tiny_config(tmp_path, shards)
    started = time.monotonic()
    failed = run_cli(TRAIN, "--config", str(config), f"run.run_dir={read_only_folder}",
                     env={"MLFLOW_TRACKING_URI": ""}, timeout=60)
    assert failed.returncode == 1
    [line] = error_lines(failed)
    assert line.startswith(f"trainer.main: error: run_dir {read_only_folder} cannot be "
                           "written ("), line
    assert "set run.run_dir to a folder this user can write" in line
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_second_run_on_a_run_dir_in_use_is_refused_and_the_first_finishes(tmp_path, shards):
    """The first run (one epoch) is frozen (SIGSTOP) once it has started tracking, so the second
    one surely starts while the first holds the folder; then the first goes on to the end."""
    config, run_dir, log = tiny_config(tmp_path, shards), tmp_path / "run", tmp_path / "first.log"
    one_epoch = ["optim.epochs=1", "optim.anneal_last_epochs=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with log.open("w") as output:
        first = subprocess.Popen([sys.executable, "-m", "trainer.main", "--config", str(config),
                                  *one_epoch],
                                 cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "tracking: MLflow run" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        first.send_signal(signal.SIGSTOP)
        second = run_cli(TRAIN, "--config", str(config), *one_epoch,
                         env={"MLFLOW_TRACKING_URI": ""}, timeout=300)
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=600)
    finally:
        first.kill()
    assert second.returncode == 1, second.stderr[-4000:]
    [line] = error_lines(second)
    refusal = IN_USE.format(run_dir, first.pid, run_dir / LOCK)
    assert re.fullmatch(f"trainer.main: error: {refusal}" + r" \(--debug shows the traceback\)",
                        line), line
    assert first.returncode == 0, log.read_text()[-4000:]
    history = (run_dir / "history.jsonl").read_text().splitlines()
    assert [json.loads(row)["epoch"] for row in history] == [0]  # the first run's row only
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert not (run_dir / LOCK).exists()


def test_a_lock_file_that_cannot_be_taken_fails_in_one_line(tmp_path):
    """Any filesystem error while taking the lock (here LOCK is a folder) is one line naming it."""
    (tmp_path / LOCK).mkdir()
    with pytest.raises(RunDirUnwritable, match=re.escape(
            f"run_dir {tmp_path}: cannot take its lock file {tmp_path / LOCK} ([Errno 21] Is a "
            "directory")):
        RunDirLock(tmp_path).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]  # its own file removed


def refused_rank(rank: int, init_file: str, run_dir: str) -> None:
    """One of two gloo ranks entering run_dir_locked: writes the error line it ended with."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    ctx = DistContext(rank, 2, rank, torch.device("cpu"))
    try:
        with run_dir_locked(run_dir, ctx):
            line = "entered"
    except Exception as err:
        line = describe(err)
    Path(run_dir, f"rank{rank}.txt").write_text(line)
    end_process(0)


@pytest.mark.slow
def test_every_rank_stops_with_rank_zeros_error_when_its_lock_fails(tmp_path):
    """Rank 0's failure to take the lock, whatever its kind, reaches the other ranks at once
    instead of leaving them waiting in the broadcast until the group's timeout."""
    run_dir = tmp_path / "run"
    (run_dir / LOCK).mkdir(parents=True)
    started = time.monotonic()
    mp.spawn(refused_rank, args=(str(tmp_path / "store"), str(run_dir)), nprocs=2)
    lines = [(run_dir / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert lines[0].startswith(f"run_dir {run_dir}: cannot take its lock file"), lines
    assert lines[1] == lines[0]
    assert time.monotonic() - started < 20


def test_a_takeover_gives_back_a_live_lock_taken_over_meanwhile(tmp_path):
    """Between our look at a dead holder's lock and our rename of it, another run takes it over
    and links its own lock, whose inode may be the freed one (ext4 reuses them: here the file is
    rewritten in place, same inode). We rename that live lock away, must see by its token that
    it is not the one judged, put it back and refuse."""
    path = write_lock(tmp_path, heartbeat_age=STALE_SECONDS + 30, host="node-7",
                      machine="another-node", pid=4242)
    lock = RunDirLock(tmp_path)
    judge = lock._gone

    def others_takeover_meanwhile(holder: Holder, age: float) -> str | None:
        why = judge(holder, age)
        write_lock(tmp_path, host="node-8", machine="yet-another-node", pid=4343)
        return why

    lock._gone = others_takeover_meanwhile
    with pytest.raises(RunDirInUse, match=IN_USE.format(tmp_path, 4343, path)):
        lock.acquire()
    assert json.loads(path.read_text())["host"] == "node-8"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


def test_a_lock_a_third_run_took_before_the_put_back_is_named_in_an_error(tmp_path, caplog):
    """A takeover moved a live lock away (taken over after its look) and, before it could put it
    back, a third run linked LOCK: the live run has lost its lock, and the line names both."""
    write_lock(tmp_path, heartbeat_age=STALE_SECONDS + 30, host="node-7",
               machine="another-node", pid=4242)
    lock = RunDirLock(tmp_path)
    judge, read = lock._gone, lock._read

    def others_takeover_meanwhile(holder: Holder, age: float) -> str | None:
        why = judge(holder, age)
        write_lock(tmp_path, host="node-8", machine="yet-another-node", pid=4343)
        return why

    def third_run_links_meanwhile(path: Path | None = None) -> tuple[Holder | None, float]:
        found = read(path)
        if path is not None:  # the lock moved away is being looked at: LOCK is free
            write_lock(tmp_path, host="node-9", machine="a-third-node", pid=4444)
        return found

    lock._gone, lock._read = others_takeover_meanwhile, third_run_links_meanwhile
    with (caplog.at_level(logging.ERROR, logger="trainer.training.run_lock"),
          pytest.raises(RunDirInUse)):
        lock.acquire()
    assert re.search(rf"run_dir {tmp_path}: cannot put back the lock of host node-8 pid 4343 "
                     r"\(since .*\), moved away while judged: host node-9 pid 4444 "
                     r"\(since .*\) took the lock file meanwhile", caplog.text), caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


def test_a_run_whose_lock_was_taken_fails_after_its_step(tmp_path, caplog):
    """The heartbeat finding another run's lock ends the run with an error at the next step's
    check, before a SIGTERM's stop with a checkpoint, and leaves the other run's lock alone."""
    lock = RunDirLock(tmp_path, heartbeat_seconds=0.05)
    with stop_on_sigterm(), caplog.at_level(logging.ERROR, logger="trainer.training.run_lock"):
        lock.acquire()
        assert stop_requested(tmp_path, CPU) is None
        write_lock(tmp_path, host="node-7", machine="another-node", pid=4242)
        os.kill(os.getpid(), signal.SIGTERM)
        lock._heartbeat.join(timeout=5)
        with pytest.raises(RunDirLost) as lost:
            stop_requested(tmp_path, CPU)
        lock.release()
    assert str(lost.value) == (f"run_dir {tmp_path}: its lock file {tmp_path / LOCK} is no "
                               "longer this run's (held by host node-7 pid 4242); another run "
                               "may be writing into the folder: this run stopped without saving "
                               "anything there; resume it (--resume latest) once that run is "
                               "done"), lost.value
    assert "stopping after this step without a checkpoint" in caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "node-7"


def test_a_training_whose_lock_was_taken_ends_failed_writing_nothing(tmp_path, shards,
                                                                      monkeypatch):
    """No checkpoint, PREEMPTED or pruning in a folder another run now holds: the training
    raises after its step, its MLflow run FAILED with the error, and the other run's LOCK
    stays."""
    from trainer.main import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    cfg = small_config(shards, run_dir, run={"run_dir": str(run_dir), "log_every_steps": 1})
    with stop_on_sigterm():
        lock = RunDirLock(run_dir, heartbeat_seconds=0.05)
        lock.acquire()
        write_lock(run_dir, host="node-7", machine="another-node", pid=4242)
        lock._heartbeat.join(timeout=5)
        with pytest.raises(RunDirLost, match="no longer this run's") as lost:
            train(cfg, CPU, resume="latest")
        lock.release()
    assert not (run_dir / "checkpoints").exists() and not (run_dir / DONE).exists()
    assert json.loads((run_dir / LOCK).read_text())["host"] == "node-7"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("defrag").experiment_id])[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == f"RunDirLost: {lost.value}"


def test_a_lock_taken_during_the_validation_fails_the_run_before_the_epochs_writes(
        tmp_path, shards, monkeypatch):
    """The lock lost while the epoch's validation runs: no history line, best model or
    end-of-epoch checkpoint (nor its pruning) follows."""
    from trainer.main import train
    from trainer.training.loop import Trainer

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    cfg = small_config(shards, run_dir, run={"run_dir": str(run_dir), "log_every_steps": 1})
    lock = RunDirLock(run_dir, heartbeat_seconds=0.05)
    validate = Trainer.validate

    def lock_taken_meanwhile(trainer: Trainer, epoch: int) -> dict[str, float]:
        metrics = validate(trainer, epoch)
        write_lock(run_dir, host="node-7", machine="another-node", pid=4242)
        lock._heartbeat.join(timeout=5)
        return metrics

    monkeypatch.setattr(Trainer, "validate", lock_taken_meanwhile)
    with stop_on_sigterm():
        lock.acquire()
        with pytest.raises(RunDirLost, match="no longer this run's"):
            train(cfg, CPU, resume="latest")
        lock.release()
    assert not {"checkpoints", "history.jsonl", "best"} & {p.name for p in run_dir.iterdir()}
    assert json.loads((run_dir / LOCK).read_text())["host"] == "node-7"


def test_heartbeats_are_timed_by_the_filesystems_clock(tmp_path, monkeypatch):
    """On NFS a lock's mtime is the server's time: a local clock an hour ahead must not make a
    fresh lock look dead, nor one an hour behind a dead one alive. (Only the local clock can be
    moved in a test, so this checks that the age is measured against the filesystem's.)"""
    real = time.time
    path = write_lock(tmp_path, host="node-7", machine="another-node", pid=4242)
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    with pytest.raises(RunDirInUse, match=IN_USE.format(tmp_path, 4242, path)):
        RunDirLock(tmp_path).acquire()
    monkeypatch.undo()
    write_lock(tmp_path, heartbeat_age=STALE_SECONDS + 30, host="node-7",
               machine="another-node", pid=4242)
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    monkeypatch.undo()
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_lock_moved_away_and_back_by_a_takeover_attempt_does_not_stop_the_run(tmp_path):
    """A run judging our lock renames it away and, finding it live, puts it back, 2 s later on a
    slow NFS server: a heartbeat that falls in between looks again LOOK_AGAIN_SECONDS later."""
    lock = RunDirLock(tmp_path, heartbeat_seconds=0.05)
    path, moved = tmp_path / LOCK, tmp_path / "LOCK.stale.other"
    with stop_on_sigterm():
        lock.acquire()
        os.rename(path, moved)
        time.sleep(2)
        os.link(moved, path)
        moved.unlink()
        time.sleep(3.5)  # 5.5 s after the move: past the heartbeat's second look
        assert stop_requested(tmp_path, CPU) is None
        assert lock._heartbeat.is_alive()
        lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_lock_that_stays_gone_fails_the_run(tmp_path):
    lock = RunDirLock(tmp_path, heartbeat_seconds=0.05, look_again_seconds=0.1)
    with stop_on_sigterm():
        lock.acquire()
        (tmp_path / LOCK).unlink()
        lock._heartbeat.join(timeout=5)
        with pytest.raises(RunDirLost, match=r"is no longer this run's \(gone\)"):
            stop_requested(tmp_path, CPU)
        lock.release()
