"""A stage's way out: rings to each instance of the next stage, plus a wakeup socket each.

`try_put(i, put, record)` writes a record into the ring to instance `i` and
sends that instance an ITEM_BATCH wakeup; it returns False when the ring is
full (or not there yet), and the caller keeps the record and tries later,
which is how backpressure travels upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import zmq

from pipeline.core.errors import FabricError
from pipeline.transport import wire
from pipeline.transport.ring import Ring
from pipeline.transport.ring_port import RingPort
from pipeline.transport.topology import Wired, internal_address, rings_from


class Outlet:
    def __init__(
        self, context: zmq.Context, settings: Wired, src_label: str, dst_stage: str
    ) -> None:
        specs = [r for r in rings_from(settings, src_label) if r.dst.startswith(dst_stage + "-")]
        self.ports = [RingPort(r.name) for r in specs]
        self.wakeups = []
        for spec in specs:
            sock = wire.open_socket(
                context, zmq.PUSH, send_hwm=16, connect=internal_address(settings, spec.dst)
            )
            self.wakeups.append(sock)

    def __len__(self) -> int:
        return len(self.ports)

    def try_put(self, i: int, put: Callable[[Ring, object], int | None], record: object) -> bool:
        port = self.ports[i]
        ring = port.get()
        if ring is None or put(ring, record) is None:
            port.stale()
            return False
        with contextlib.suppress(FabricError):  # a wakeup already queued is enough
            wire.send(
                self.wakeups[i],
                wire.MessageType.ITEM_BATCH,
                {"ring": port.name, "start": 0, "end": 0, "count": 0},
            )
        return True

    def close(self) -> None:
        for port in self.ports:
            port.close()
        for sock in self.wakeups:
            sock.close(0)
