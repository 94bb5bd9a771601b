"""Free ports for generated configs, reserved host-wide (pipeline/transport/ports.py): two test suites,
or `run.py batch` next to a test run, on one host never pick the same port, even while the
broker on it is killed and down."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from broker import REPO, Broker, write_config
from conftest import wait_for

from pipeline.transport.binds import bound, host_port
from pipeline.transport.ports import (
    EPHEMERAL_RANGE,
    free_loopback_ports,
    release_ports,
    reserved_ports,
)

# Another process on the host: it picks n ports from the candidates, prints them, and holds
# them until its stdin closes (or it is killed).
PICKER = (
    "import json, sys; from pipeline.transport.ports import free_loopback_ports; "
    "print(json.dumps(free_loopback_ports(int(sys.argv[1]), json.loads(sys.argv[2]))), "
    "flush=True); sys.stdin.read()"
)


def picker(n: int, candidates: list[int]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PICKER, str(n), json.dumps(candidates)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def picked(proc: subprocess.Popen) -> set[int]:
    """The ports a picker printed (it holds them until `end`)."""
    return set(json.loads(proc.stdout.readline()))


def end(proc: subprocess.Popen, sig: int | None = None) -> None:
    if sig is not None:
        proc.send_signal(sig)
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


def nothing_listens(ports) -> bool:
    """No socket listens on any of `ports` (one in TIME_WAIT may stay: a broker binds over it,
    with SO_REUSEADDR)."""
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def test_generated_ports_are_free_distinct_reserved_and_below_the_ephemeral_range():
    """Outgoing connections take their ports from the ephemeral range: a port picked there
    can be taken while a killed broker restarts, and the new broker cannot bind it."""
    low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    ports = free_loopback_ports(12)
    assert len(set(ports)) == 12
    assert all(20_000 <= p < low for p in ports), (ports, low)
    assert set(ports) <= reserved_ports()
    assert nothing_listens(ports)
    release_ports(ports)
    assert not set(ports) & reserved_ports()


def test_a_taken_candidate_is_skipped_and_the_kernel_picks_when_none_is_left():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert taken not in free_loopback_ports(1, candidates=[taken, taken])


def test_a_port_another_process_reserved_is_skipped_until_it_gives_it_back_or_dies():
    """Nothing listens on the reserved ports: only the host-wide registry keeps them."""
    ours = free_loopback_ports(3)
    other = picker(3, ours)
    try:
        assert not picked(other) & set(ours)
    finally:
        end(other)
    release_ports(ours)
    other = picker(3, ours)
    try:
        assert picked(other) == set(ours)
        assert not set(free_loopback_ports(3, candidates=ours)) & set(ours)
    finally:
        end(other, signal.SIGKILL)  # the kernel drops a killed process's reservations
    assert set(free_loopback_ports(3, candidates=ours)) == set(ours)


def test_processes_picking_from_the_same_ports_at_once_get_distinct_ones():
    candidates = free_loopback_ports(30)
    release_ports(candidates)
    pickers = [picker(10, candidates) for _ in range(3)]
    try:
        got = [picked(p) for p in pickers]
    finally:
        for p in pickers:
            end(p)
    assert len(got[0] | got[1] | got[2]) == 30, got


def test_a_killed_brokers_ports_stay_its_own_until_it_restarts_on_them(tmp_path):
    """The common crash test: the broker is SIGKILLed, and, while nothing listens on its
    ports, another suite on the host picks ports; the broker then starts again on its own."""
    broker = Broker(write_config(tmp_path), stderr_path=tmp_path / "broker.err").start()
    ports = [host_port(address)[1] for _, address in bound(broker.settings)]
    try:
        broker.kill()
        wait_for(lambda: nothing_listens(ports), "the killed broker's stages to let go")
        other = picker(len(ports), ports)
        try:
            assert not picked(other) & set(ports)
        finally:
            end(other)
        broker.start()
    finally:
        broker.close()
