"""The ZAP authenticator thread of a CURVE server (pipeline/transport/security.py `ServerGate`).

Its own module because pyzmq's `zmq.auth.thread` imports asyncio (about 40 ms of
CPU): only a process that serves CURVE pays for it, not every client command,
worker and supervisor that imports pipeline/transport/security.py.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("fabric.security")


class ZapGate(ThreadAuthenticator):
    """The ZAP authenticator thread; tells `AuthorizedKeys` which peer address it judges."""

    def __init__(self, context: zmq.Context, keys) -> None:
        super().__init__(context, log=log)
        self.authorized = keys

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:  # version, request id, domain, address, ...
            self.authorized.peer = msg[3].decode(errors="replace") or "?"
        await super().handle_zap_message(msg)
