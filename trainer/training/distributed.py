"""Where this process sits in a training job: the process group that torchrun describes (or a
group of one), its rank and device, naming the ranks lost when a collective fails, and leaving
it. The loss gathers the global batch itself (trainer/objectives.py, docs/design.md section 7).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    """Where this process sits: its rank, the world size and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    peers: tuple[str, ...] = ()  # every rank's "host address port" of its liveness socket

    @property
    def is_main(self) -> bool:
        return self.rank == 0


PROBE_SECONDS = 3.0  # a peer's liveness socket that takes no connection in this time is lost
_liveness: list[socket.socket] = []  # this rank's, open while the process runs


class PeerLost(RuntimeError):
    """A collective failed and some other ranks no longer answer; the message names them."""


def init_distributed(device: str = "auto", timeout: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes (or a group of one): NCCL on GPU, else gloo;
    a collective waits `timeout` seconds for the other ranks, then fails."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device is cuda but torch sees no GPU; use run.device=cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    where = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))  # DeepSpeed reads it
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        store, rank, world_size = next(dist.rendezvous("env://"))
        # torchrun keeps one store across restarts: a restarted group must not read the
        # addresses its killed predecessors published there.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"defrag-attempt-{attempt}", store)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, device_id=where if use_cuda else None,
                                timeout=timedelta(seconds=timeout))
        return DistContext(rank, world_size, local_rank, where,
                           _swap_liveness(store, rank, world_size))
    return DistContext(rank, world_size, local_rank, where)


def _swap_liveness(store: dist.Store, rank: int, world_size: int) -> tuple[str, ...]:
    """Open this rank's liveness socket on the address other nodes reach it at (the kernel
    takes a probe's connection while the process lives, whatever it is doing) and swap their
    addresses through the store."""
    address = advertised_address()
    _liveness.append(socket.create_server((address, 0), backlog=128))
    port = _liveness[-1].getsockname()[1]
    store.set(f"alive/{rank}", f"{socket.gethostname()} {address} {port}")
    return tuple(store.get(f"alive/{other}").decode() for other in range(world_size))


def advertised_address() -> str:
    """This node's address as the others reach it: the source of its route to MASTER_ADDR, else
    the address its host name resolves to (gloo's rule), the first that is not a loopback one
    (127.0.1.1 is Debian's for the host name); 127.0.0.1 when both are (a job on one host)."""
    found = []
    with contextlib.suppress(OSError, KeyError), \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
        route.connect((os.environ["MASTER_ADDR"], 9))  # UDP: picks the route, sends nothing
        found.append(route.getsockname()[0])
    with contextlib.suppress(OSError):
        found.append(socket.gethostbyname(socket.gethostname()))
    return next((a for a in found if not ipaddress.ip_address(a).is_loopback), "127.0.0.1")


def lost_peers(ctx: DistContext, seconds: float = PROBE_SECONDS) -> list[str]:
    """The other ranks whose liveness socket takes no connection within `seconds` (probed
    together), each as `rank R (host, address: why)`."""

    def lost(rank: int) -> str | None:
        host, address, port = ctx.peers[rank].split()
        try:
            socket.create_connection((address, int(port)), timeout=seconds).close()
        except OSError as err:
            return f"rank {rank} ({host}, {address}: {err.strerror or err})"
        return None

    others = [rank for rank in range(len(ctx.peers)) if rank != ctx.rank]
    with ThreadPoolExecutor(min(64, max(1, len(others)))) as pool:
        return [line for line in pool.map(lost, others) if line]


@contextlib.contextmanager
def peers_named(ctx: DistContext) -> Iterator[None]:
    """A RuntimeError in the block (a collective that failed: a peer killed, or silent past
    run.collective_timeout) becomes PeerLost naming the ranks that no longer answer, if any."""
    try:
        yield
    except RuntimeError as err:
        lost = lost_peers(ctx) if ctx.peers else []
        if not lost:
            raise
        detail = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).splitlines() or [""])[0])
        raise PeerLost(f"rank {ctx.rank} ({socket.gethostname()}): lost {', '.join(lost)}: "
                       f"its node is down, its link cut or its process gone ({detail}); resume "
                       "from the last checkpoint (--resume latest) once it is back") from err


def end_process(code: int) -> NoReturn:
    """Leave a rank's process: its process group destroyed, output flushed, and no interpreter
    teardown, where gloo's and DeepSpeed's threads sometimes abort the process ("terminate
    called without an active exception", docs/design.md section 7)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
