"""Global-batch negatives: gather every rank's fragments with autograd (DESIGN.md section 4).

Each rank embeds its own pairs, gathers the fragment embeddings and owners of all ranks, and
computes only the loss terms of its own pairs (`DeFragLoss(..., own_pairs=...)`). The gather's
backward sums the gradients of every rank's loss into the rows of the rank that owns them, so
the ranks' parameter gradients sum to those of one process on the whole batch.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def all_gather_rows(x: Tensor, sizes: list[int], group: dist.ProcessGroup | None = None) -> Tensor:
    """Concatenate the rows of `x` from every rank (rank r holds sizes[r] rows), differentiably.

    Row counts differ per rank: pad to the largest, gather, then drop the padding.
    """
    group = group or dist.group.WORLD
    longest = max(sizes)
    padded = torch.cat([x, x.new_zeros(longest - len(x), *x.shape[1:])])
    gathered = funcol.all_gather_single(padded.contiguous(), 0, group)
    lengths = torch.tensor(sizes, device=x.device)
    keep = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]
    return gathered[keep.flatten()]


def sum_over_ranks(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-reduce (sum) a copy of `x`, without gradient: the loss's global label counts."""
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return total


@dataclass
class GlobalBatch:
    """The fragments of every rank's pairs, with pair indices renumbered globally."""

    v: Tensor
    v_owner: Tensor
    s: Tensor
    s_owner: Tensor
    image_key: Tensor
    own_pairs: Tensor  # bool [B_global]: the pairs of this rank


def gather_global_batch(v: Tensor, v_owner: Tensor, s: Tensor, s_owner: Tensor,
                        image_key: Tensor, group: dist.ProcessGroup | None = None) -> GlobalBatch:
    """All-gather a rank's local batch (pair indices 0..B_local-1) into the global batch."""
    counts = torch.tensor([len(image_key), len(v), len(s)], device=v.device)
    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, counts, group=group)
    pairs, v_sizes, s_sizes = torch.stack(everyone).T.tolist()
    rank = dist.get_rank(group)
    offset = sum(pairs[:rank])
    own_pairs = torch.zeros(sum(pairs), dtype=torch.bool, device=v.device)
    own_pairs[offset:offset + len(image_key)] = True
    return GlobalBatch(
        v=all_gather_rows(v, v_sizes, group),
        v_owner=all_gather_rows(v_owner + offset, v_sizes, group),
        s=all_gather_rows(s, s_sizes, group),
        s_owner=all_gather_rows(s_owner + offset, s_sizes, group),
        image_key=all_gather_rows(image_key, pairs, group),
        own_pairs=own_pairs,
    )


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
    called without an active exception", DESIGN.md section 7)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
