"""How the holdings of workers come back to a dispatch stage that restarted (invariants 8, 11).

Two ways, both through `DispatchState.adopt`: at `open()`, the leases of this
broker life still out, from the dispatch file (their sessions are known again,
unregistered, until they say hello or time out); and at each WORKER_HELLO,
the items the worker says it holds, honoured only where a work token of this
data dir covers them (gpu/dispatch/work_token.py). The WELCOME answer says
per claimed item whether the worker should keep it (docs/dispatch.md,
re-registration). These functions work on the stage, as gpu/dispatch/report.py
reads it.
"""

from __future__ import annotations

import numpy as np

from gpu.dispatch.batch import item_array
from gpu.dispatch.sessions import Session
from pipeline.transport import wire

MT = wire.MessageType


def reload_leases(stage, now: float) -> None:
    """Adopt the leases the dispatch file reloaded; their sessions exist again, unregistered."""
    leases = stage.leases.reloaded
    for lease in leases:
        held = stage.state.adopt(lease.session, lease.items, now, batch_id=lease.batch_id)
        if (held == 1).any() and lease.session not in stage.sessions:
            stage.sessions[lease.session] = Session(lease.session.encode(), "", now)
            stage.stall.registered(lease.session, now)
    if leases:
        stage.log.info(
            "reloaded %d lease(s) of %d session(s) from the dispatch file (epoch %d)",
            len(leases),
            len(stage.sessions),
            stage.epoch,
        )


def hello(stage, message: wire.Message, session_id: str, now: float) -> None:
    """A WORKER_HELLO: register the session, adopt what it holds that a token covers, WELCOME."""
    held = item_array(message, "held")
    model = str(message.meta["model"])
    stage.sessions[session_id] = Session(session_id.encode(), model, now)
    stage.stall.registered(session_id, now)
    proven, failed = stage.tokens.covered(
        session_id, message.meta.get("tokens"), item_array(message, "issued"), held
    )
    if failed or not proven.all():  # never handed to it by this data dir: answered 0
        stage.refused.add(
            "claims",
            session_id,
            f"{int((~proven).sum())} of {len(held)} claimed item(s) are in no batch whose "
            f"work token verifies ({failed} token(s) failed)",
            now,
        )
    known = np.zeros(len(held), np.uint8)
    known[proven] = stage.state.adopt(session_id, held[proven], now)
    if (known > 0).any():
        stage.came_back_holding.add(session_id)  # came back with live work (status answer)
    stage.log.info(
        "session %s (model %s) registered holding %d item(s): %d still live",
        session_id,
        model,
        len(held),
        int((known > 0).sum()),
    )
    for batch in stage.state.leases(session_id):
        stage.leases.record(batch)
    stage.send(
        session_id.encode(),
        MT.WELCOME,
        {
            "epoch": stage.epoch,
            "lease_s": stage.config.lease_s,
            "report_s": stage.config.report_s,
        },
        {"known": known},
    )
