"""Free ports for generated configs (pipeline/topology.py free_loopback_ports)."""

from __future__ import annotations

import socket
from pathlib import Path

from pipeline.topology import EPHEMERAL_RANGE, free_loopback_ports


def test_generated_ports_are_free_distinct_and_below_the_ephemeral_range():
    """Outgoing connections take their ports from the ephemeral range: a port picked there
    can be taken while a killed broker restarts, and the new broker cannot bind it."""
    low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    ports = free_loopback_ports(12)
    assert len(set(ports)) == 12
    assert all(20_000 <= p < low for p in ports), (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_candidate_is_skipped_and_the_kernel_picks_when_none_is_left():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert taken not in free_loopback_ports(1, candidates=[taken, taken])
