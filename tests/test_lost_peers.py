"""A collective that fails names the ranks that no longer answer (trainer/training/distributed.py
`peers_named`): each rank's liveness socket, probed with real connections on 127.0.0.1. The
faults themselves (a node killed, its link cut) are tests/test_cluster.py's."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import psutil
import pytest
import torch
import torch.distributed as dist

from trainer.training.distributed import (
    DistContext,
    PeerLost,
    _liveness,
    _swap_liveness,
    advertised_address,
    lost_peers,
    peers_named,
)

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


def an_outside_address() -> str:
    """An IPv4 address of this machine's that is not a loopback one."""
    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    if not found:
        pytest.skip("this machine has no IPv4 address but loopback ones")
    return found[0]


def test_a_rank_listens_on_and_names_the_address_of_its_route_to_the_master(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not every interface, and not a loopback address a peer on another node would probe as
    its own: the source address of the route to MASTER_ADDR (the master's own node included)."""
    outside = an_outside_address()
    monkeypatch.setenv("MASTER_ADDR", outside)
    assert advertised_address() == outside
    [peer] = _swap_liveness(dist.HashStore(), 0, 1)
    assert peer.split()[1:] == [outside, str(_liveness[-1].getsockname()[1])]
    assert _liveness[-1].getsockname()[0] == outside
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one host: its name's address, if not loopback
    named = socket.gethostbyname(socket.gethostname())
    assert advertised_address() == (
        "127.0.0.1" if ipaddress.ip_address(named).is_loopback else named)
