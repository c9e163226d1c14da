"""One run per run_dir: rank 0 holds `<run_dir>/LOCK` while its run uses the folder, so a second
run on it is refused in one line naming the holder instead of mixing checkpoints, history.jsonl
and MLflow records (or dying in the embedded store's migration when both start on a new folder).

The lock file appears whole and atomically: the holder's JSON (host, pid, since, ...) is written
to a file of this process's own and hard-linked to LOCK. link() fails if LOCK exists, atomically
on NFS (every version, unlike O_EXCL, which NFSv2 clients only emulate), Lustre, GPFS and local
filesystems, and no reader ever sees a half-written holder; a link that NFS retried after its
lost reply (EEXIST, though it worked) is recognised by the file's link count.

A lock whose holder is gone is taken over, with a warning:
- its holder ran on this machine (host, boot and pid namespace) and that process (pid and start
  time, so a reused pid does not count) no longer runs;
- or it ran elsewhere (nodes sharing the filesystem) and its heartbeat, the file's mtime that the
  holder refreshes every HEARTBEAT_SECONDS, is older than STALE_SECONDS (timed by the
  filesystem's clock, a file of this run's touched there, not by the nodes' clocks);
- or it belongs to this same job (torchrun's run id: launch/slurm/train.sbatch passes the SLURM
  job id) and its heartbeat has stopped (OWN_JOB_STALE_SECONDS): a torchrun restart or a requeue
  whose previous rank 0 died holding it, perhaps on another node.
A takeover renames the judged file away and checks by its token that it moved that very file
(not a lock another run took over meanwhile, which it puts back, logging an error naming both
if a third run took LOCK before that), so two runs taking over together cannot both win. A
heartbeat finding LOCK missing looks again LOOK_AGAIN_SECONDS later (a slow move and put-back).
A run suspended (SIGSTOP) for longer than STALE_SECONDS loses its lock to a run on another node;
its heartbeat then ends it after the step with RunDirLost, saving nothing there
(trainer/training/preemption.py `fail_after_step`), and leaves the other run's lock alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from defrag.cli import describe
from trainer.training.distributed import DistContext
from trainer.training.preemption import fail_after_step

log = logging.getLogger(__name__)

LOCK = "LOCK"
HEARTBEAT_SECONDS = 20.0
STALE_SECONDS = 300.0  # a heartbeat this old means its holder on another node is gone
OWN_JOB_STALE_SECONDS = 3 * HEARTBEAT_SECONDS
LOOK_AGAIN_SECONDS = 5.0  # a missing LOCK, maybe moved away and back by a takeover attempt


class RunDirInUse(RuntimeError):
    """Another live run holds the run_dir's lock."""


class RunDirUnwritable(RuntimeError):
    """The run_dir cannot be created or written (read-only, no permission)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the refusal line names, and what tells whether it still runs."""

    host: str
    pid: int
    since: str  # UTC, for people
    machine: str  # boot id and pid namespace: where `pid` names this very process
    started: str  # the process's start time since boot, against pid reuse
    job: str  # torchrun's run id ('' without torchrun)
    token: str  # random: tells this lock from any other

    @classmethod
    def me(cls) -> Holder:
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return cls(socket.gethostname(), os.getpid(),
                   time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), _machine(),
                   _start_time(os.getpid()), "" if job == "none" else job, secrets.token_hex(8))


def _machine() -> str:
    """This machine and pid namespace (containers on one host may share host names, not pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: the host name alone
        return socket.gethostname()


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (the start time in ticks since boot); '' when the process
    does not run (a zombie, killed but not yet reaped, included) or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    return "" if fields[0] == "Z" else fields[19]


def _runs(holder: Holder) -> bool:
    """Whether `holder`'s process, on this machine, still runs."""
    if holder.started:
        return _start_time(holder.pid) == holder.started
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _named(holder: Holder | None) -> str:
    """A holder as the log lines name it."""
    return f"host {holder.host} pid {holder.pid} (since {holder.since})" if holder else "nobody"


class RunDirLock:
    """`<run_dir>/LOCK` held by this process: `acquire` (raises RunDirInUse naming a live
    holder), a heartbeat thread while held, `release`."""

    def __init__(self, run_dir: str | Path, heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 look_again_seconds: float = LOOK_AGAIN_SECONDS) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.heartbeat_seconds = heartbeat_seconds
        self.look_again_seconds = look_again_seconds
        self.holder = Holder.me()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        mine = self.run_dir / f"{LOCK}.{self.holder.token}"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            mine.write_text(json.dumps(asdict(self.holder)))
        except OSError as err:
            raise RunDirUnwritable(
                f"run_dir {self.run_dir} cannot be written ({err.strerror or err}): the run "
                "keeps its lock, checkpoints, best model and MLflow store there; make it "
                "writable or set run.run_dir to a folder this user can write") from err
        try:
            for _ in range(5):  # LOCK released or taken over between two looks: look again
                if self._link(mine):
                    break
                self._remove_if_stale(mine)
            else:
                raise RunDirInUse(f"run_dir {self.run_dir}: its lock file {self.path} keeps "
                                  "changing hands; another run is starting on it")
        except OSError as err:  # e.g. LOCK a folder, or another user's in a sticky folder
            raise RunDirUnwritable(
                f"run_dir {self.run_dir}: cannot take its lock file {self.path} ({err}); if no "
                "run uses the folder, remove the lock file as its owner, or set run.run_dir to "
                "another folder") from err
        finally:
            mine.unlink(missing_ok=True)
        self._heartbeat = threading.Thread(target=self._beat, name="run-dir-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self._read()[0] == self.holder:  # never another run's lock
            self.path.unlink(missing_ok=True)

    def _link(self, mine: Path) -> bool:
        """Whether LOCK is now `mine` (hard-linked)."""
        try:
            os.link(mine, self.path)
        except FileExistsError:
            return mine.stat().st_nlink == 2  # NFS: a retried link whose first try worked
        except OSError as err:
            raise RunDirUnwritable(f"run_dir {self.run_dir}: cannot create its lock file "
                                   f"{self.path} ({err.strerror or err}); the run needs a "
                                   "filesystem with hard links there") from err
        return True

    def _read(self, path: Path | None = None) -> tuple[Holder | None, float]:
        """The holder of LOCK (or of `path`; None when there is no such file) and its heartbeat
        (mtime). A file that is not a holder's JSON (made by hand): an unknown holder."""
        try:
            with (path or self.path).open() as file:
                stat = os.fstat(file.fileno())
                text = file.read()
        except FileNotFoundError:
            return None, 0.0
        try:
            holder = Holder(**json.loads(text))
        except (ValueError, TypeError):
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stat.st_mtime))
            holder = Holder("unknown", 0, since, "", "", "", "")
        return holder, stat.st_mtime

    def _remove_if_stale(self, mine: Path) -> None:
        """Remove LOCK if its holder is gone (logged); RunDirInUse if it still runs. The
        heartbeat's age is timed by `mine` touched now: the filesystem's clock, as LOCK's mtime."""
        holder, beat = self._read()
        if holder is None:  # released meanwhile
            return
        os.utime(mine)  # on NFS the server's time, which other nodes' clocks may differ from
        age = mine.stat().st_mtime - beat
        gone = self._gone(holder, age)
        if gone is None:
            raise RunDirInUse(
                f"run_dir {self.run_dir} is in use by host {holder.host} pid {holder.pid} since "
                f"{holder.since} (its lock file {self.path}, refreshed {age:.0f} s ago); wait "
                "for it or use another run.run_dir")
        moved = self.run_dir / f"{LOCK}.stale.{self.holder.token}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:  # another run took it over first
            return
        live = self._read(moved)[0]
        if live != holder:  # its token says: another run's lock, taken over in between
            self._put_back(moved, live)
        else:
            log.warning("run_dir %s: taking over the lock of host %s pid %s (since %s): %s",
                        self.run_dir, holder.host, holder.pid, holder.since, gone)
        moved.unlink()

    def _put_back(self, moved: Path, live: Holder | None) -> None:
        """Give back `live`'s lock, moved away to `moved`; if a third run linked LOCK meanwhile,
        `live` has lost it (its heartbeat will fail its run): an error naming both."""
        try:
            os.link(moved, self.path)
        except FileExistsError:
            log.error("run_dir %s: cannot put back the lock of %s, moved away while judged: %s "
                      "took the lock file meanwhile; that run, having lost its lock, fails at "
                      "its next heartbeat", self.run_dir, _named(live), _named(self._read()[0]))

    def _gone(self, holder: Holder, age: float) -> str | None:
        """Why `holder` no longer holds the lock, or None while it does."""
        if holder.machine == self.holder.machine:
            return None if _runs(holder) else "that process no longer runs"
        if holder.job and holder.job == self.holder.job and age > OWN_JOB_STALE_SECONDS:
            return (f"an earlier process of this job (torchrun run id {holder.job}), no "
                    f"heartbeat for {age:.0f} s")
        if age > STALE_SECONDS:
            return f"no heartbeat for {age:.0f} s (more than {STALE_SECONDS:.0f} s)"
        return None

    def _beat(self) -> None:
        """Refresh LOCK's mtime until released. If it is no longer ours, the run fails after its
        step, saving nothing, saying why: another run may be writing there."""
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                holder = self._read()[0]
                if holder is None:  # a run that judged it live may be putting it back: look again
                    if self._stop.wait(self.look_again_seconds):
                        return
                    holder = self._read()[0]
                if holder != self.holder:
                    now = f"held by host {holder.host} pid {holder.pid}" if holder else "gone"
                    why = (f"run_dir {self.run_dir}: its lock file {self.path} is no longer this "
                           f"run's ({now})")
                    log.error("%s; another run may be writing into the folder: stopping after "
                              "this step without a checkpoint", why)
                    fail_after_step(why)
                    return
                os.utime(self.path)
            except OSError as err:  # a filesystem hiccup: the next beat tries again
                log.warning("run_dir %s: cannot refresh its lock file: %s", self.run_dir, err)


@contextlib.contextmanager
def run_dir_locked(run_dir: str | Path, ctx: DistContext) -> Iterator[None]:
    """Rank 0 holds the run_dir's lock for the block. Collective: every rank gets rank 0's
    failure (a refusal or any error) as its own one line, so the job stops at once on every
    rank."""
    lock = RunDirLock(run_dir) if ctx.is_main else None
    error: Exception | None = None
    if lock is not None:
        try:
            lock.acquire()
        except Exception as err:  # whatever it is, the broadcast tells the ranks waiting in it
            error = err
    refusal = [describe(error) if error else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise error or RuntimeError(refusal[0])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
