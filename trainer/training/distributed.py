"""Where this process sits in a training job: the process group that torchrun describes (or a
group of one), its rank and device, and leaving it. The loss gathers the global batch itself
(trainer/objectives.py, docs/design.md section 7).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistContext:
    """Join the process group torchrun describes (or a group of one): NCCL on GPU, else gloo."""
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
                                world_size=world_size, device_id=where if use_cuda else None)
    return DistContext(rank, world_size, local_rank, where)


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
