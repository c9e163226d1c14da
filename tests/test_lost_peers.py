"""A collective that fails names the ranks that no longer answer (trainer/training/distributed.py
`peers_named`): each rank's liveness socket, probed with real connections on 127.0.0.1. The
faults themselves (a node killed, its link cut) are tests/test_cluster.py's."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch

from trainer.training.distributed import DistContext, PeerLost, lost_peers, peers_named

GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "


@pytest.fixture
def ctx() -> Iterator[DistContext]:
    """Rank 0 of 3: rank 1 listens, rank 2's port takes no connection (its process is gone)."""
    live, gone = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    ports = [0, live.getsockname()[1], gone.getsockname()[1]]
    gone.close()
    peers = [f"h{rank} 127.0.0.1 {port}" for rank, port in enumerate(ports)]
    yield DistContext(0, 3, 0, torch.device("cpu"), tuple(peers))
    live.close()


def test_a_gone_rank_is_named_and_a_live_one_is_not(ctx: DistContext) -> None:
    assert lost_peers(ctx) == ["rank 2 (h2, 127.0.0.1: Connection refused)"]


def test_a_failed_collective_names_the_lost_rank_in_one_line(ctx: DistContext) -> None:
    with pytest.raises(PeerLost) as raised, peers_named(ctx):
        raise RuntimeError(GLOO + "20000ms for recv operation to complete\nmore")
    message = str(raised.value)
    assert message.startswith(f"rank 0 ({socket.gethostname()}): lost rank 2 (h2, 127.0.0.1: "
                              "Connection refused): ")
    assert "(Timed out waiting 20000ms for recv operation to complete)" in message
    assert "\n" not in message and "unbound_buffer" not in message


def test_other_errors_pass_unchanged(ctx: DistContext) -> None:
    alive = DistContext(0, 2, 0, torch.device("cpu"), ctx.peers[:2])
    with pytest.raises(RuntimeError, match="^out of memory$"), peers_named(alive):
        raise RuntimeError("out of memory")  # every peer answers: not a lost one
    with pytest.raises(ValueError), peers_named(ctx):
        raise ValueError("a bad value")
