"""A worker session: pull batches ahead, keep the engine busy, return results, lose nothing.

`python run.py worker --broker ADDR --model M --engine E` runs one `Worker`
(`run_worker`); the supervisor runs `[workers] local = N` of them as
`WorkerStage`s (gpu/worker/worker_stage.py).

Two threads. The engine thread (gpu/worker/engine_thread.py) takes batches
from a queue and runs them. The network thread (the caller of `step(now)`,
this module) owns the sockets (gpu/worker/connection.py) and all state: it
registers (gpu/worker/registration.py), asks for work while the queue has room (`prefetch` batches
ahead, so the engine never waits), sends results as they finish and
keeps them until the completion stage has acknowledged them (resending after
a reconnect), reports what it holds every `report_s` (which renews its
leases), and hands back what it cannot do.

| situation                         | what the worker does                                     |
|-----------------------------------|----------------------------------------------------------|
| broker away                       | keeps working through its queue; keeps results; retries with exponential backoff and jitter |
| results not acknowledged (completion away, a full disk) | keeps them and resends every `RESEND_S`; asks for no more work while it holds 32 such batches, so its memory stays bounded |
| broker back (any restart)         | re-registers with the (segment, slot, seq) of all it holds and each batch's work token (invariant 8); drops items the broker says are retired or unknown |
| no answer at all while registering | after `NO_ANSWER_WARN_S` says so once, naming the address: keys are the usual cause (gpu/worker/registration.py) |
| RESULTS_REFUSED                   | drops those results: not work this broker's data dir handed out (gpu/dispatch/work_token.py) |
| an item's own error               | that item's error result, at once (invariant 14)           |
| TransientEngineError (out of memory in any engine for one item alone: `Engine.run` halves a batch first) | hands the batch back without an attempt; backs off |
| any other engine failure          | hands back what it holds (the failing batch counting an attempt) and exits 7 |
| a batch running past `batch_timeout_s` | the engine is hung (gpu/worker/watchdog.py): the same as a failure (the hung batch counts an attempt), exits 7 |
| batches held, none running, for `batch_timeout_s` | the engine is not taking work: the same as a failure, exits 7 |
| the engine thread ended (any cause)   | hands back all it holds (what was running counts an attempt) and exits 7: it never holds work it cannot run |
| re-registered: some held items no longer live | a queued batch with none left is skipped; a running batch is left whole, and results for the items no longer live are dropped when it finishes |
| SIGTERM                           | stops asking; hands back queued batches; finishes the running one within `drain_s`; sends results; waits for their acks; says BYE (invariant 15) |

Every message carries the session id, a fresh random id per process, which
is also the socket identity, so the broker routes replies to this process
only. Time is `step`'s `now`: only `run` and `drain`, the loops, read the
host's clock, so tests step a session on a fake one (tests/test_worker_stepped.py).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections.abc import Callable

import numpy as np

from gpu.engines.base import Engine
from gpu.worker.connection import Connection, no_answer_advice
from gpu.worker.engine_thread import EngineThread
from gpu.worker.faults import Faults
from gpu.worker.held import Held, claims, live_items, mark_gone
from gpu.worker.options import WorkerOptions
from gpu.worker.registration import Registration
from gpu.worker.results import keep_results, results_message
from gpu.worker.watchdog import Watchdog
from pipeline.core import exitcodes
from pipeline.process.stage import StopFlags
from pipeline.store.segment_format import SLOT_HEADER_WORDS
from pipeline.transport import wire

MT = wire.MessageType
log = logging.getLogger("fabric.worker")
MAX_BACKOFF_S = 5.0  # after a transient engine failure: the longest pause
RESEND_S = 10.0  # results unacknowledged this long are sent again
MAX_UNACKNOWLEDGED_BATCHES = 32  # results held for completion past this: the worker stops asking
FIRST_BATCH_TOKENS = 4096  # the first request's token budget, before the engine is measured
# The longest wait for a message: broker messages and finished batches end it at once, timers
# (hello, ping, report, a pause) are waited for exactly; this bounds only the watchdog's look.
IDLE_WAIT_MS = 100


class Worker:
    """One worker session. Call `open()`, then `step()` until done, then `close()`."""

    def __init__(self, options: WorkerOptions, engine: Engine) -> None:
        self.options = options
        self.engine = engine
        self.session = secrets.token_hex(8)
        self.connection = Connection(options.broker, options.heartbeat, options.curve, self.session)
        self.held: dict[int, Held] = {}
        self.faults = Faults(options.fault)
        self.engine_thread = EngineThread(engine, self.faults)
        self.watchdog = Watchdog(options.batch_timeout_s)
        self.registration = Registration()
        self.asking = False
        self.ask_sent = 0.0
        self.backoff = 0.2  # after a transient engine failure: the pause, before jitter
        self.last_report = 0.0
        self.last_heard = 0.0
        self.pause_until = 0.0
        self.seen_batch = 0
        self.next_result_id = 1
        self.draining = False
        self.broken: str | None = None
        self.exit_code: int | None = None
        self.completed = 0
        self.idle_s = 0.0
        self._idle_since: float | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def open(self) -> None:
        self.engine.load()
        self.connection.open()
        self.connection.watch(self.engine_thread.wake_fd)  # a finished batch ends the wait
        self.engine_thread.start()
        log.info(
            "worker session %s for model %s on %s (engine %s)",
            self.session,
            self.options.model,
            self.options.broker,
            self.engine.name,
        )

    def close(self) -> None:
        self.engine_thread.stop(timeout_s=1.0)
        self.connection.close()
        self.engine_thread.close()  # its wake fd (the connection polled it), then the engine

    def token_budget(self) -> int:
        """Tokens to ask for: what the engine does in about `target_batch_s` (within bounds);
        the most there is for an engine that `wants_full_batches`."""
        limit = self.options.batch_tokens
        target = self.options.target_batch_s
        if target <= 0 or getattr(self.engine, "wants_full_batches", False):
            return limit
        tokens_per_s = self.engine_thread.tokens_per_s
        if tokens_per_s is None:  # not measured yet: start small, it grows after a batch
            return min(limit, FIRST_BATCH_TOKENS)
        return max(1, min(limit, int(tokens_per_s * target)))

    # ---- the network thread --------------------------------------------------------------
    def step(self, now: float, timeout_ms: int | None = None) -> None:
        """One turn at time `now` (the only clock the session reads): timers, finished batches,
        then wait for the broker at most `timeout_ms` (default: until the next timer,
        `IDLE_WAIT_MS` at most; a finished batch ends it). What arrives meanwhile is handled
        at `now` too."""
        registration = self.registration
        if self.options.heartbeat is not None and registration.ping_due(now):
            self.connection.ping()
        if registration.hello_due(now):
            self._hello(now)
        silent_s = registration.silent_for(now)
        if silent_s is not None:
            log.warning("%s", no_answer_advice(self.options.broker, self.options.curve, silent_s))
        self._take_done(now)
        self._watch(now)
        if registration.registered:
            self._ask(now)
            if now - self.last_report >= registration.report_s:
                self._report(now)
            self._resend(now)
        if self.connection.poll(self.wait_ms(now) if timeout_ms is None else timeout_ms):
            for message in self.connection.messages(64):
                self.last_heard = now
                registration.heard()
                self._handle(message, now)
        for pong in self.connection.pongs():
            if pong.type == MT.PONG:
                registration.pong(pong.meta.get("epoch"), now)
        self._take_done(now)  # a batch finished during the wait: its results go now
        self._track_idle(now)

    def wait_ms(self, now: float) -> int:
        """How long `step` may wait: to the next due timer, `IDLE_WAIT_MS` at most. It woke
        every 20 ms, which idle (or while the engine computes) cost more than 1% of a core
        beside an engine that wants them all."""
        registration = self.registration
        due = [registration.next_due(now, self.options.heartbeat is not None)]
        if registration.registered:
            due.append(self.last_report + registration.report_s)
            due.append(self.pause_until if self.pause_until > now else math.inf)
        return max(0, min(IDLE_WAIT_MS, math.ceil((min(due) - now) * 1000)))

    def _track_idle(self, now: float) -> None:
        busy = any(h.state in ("queued", "running") for h in self.held.values())
        if busy or self.draining:
            if self._idle_since is not None:
                self.idle_s += now - self._idle_since
                self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now

    def idle_seconds(self, now: float) -> float:
        """Seconds this session has held no batch to run (waiting for work), up to `now`."""
        since = self._idle_since
        return max(0.0, self.idle_s + (now - since if since is not None else 0.0))

    def _send(self, kind: MT, meta: dict, arrays: dict | None = None) -> bool:
        return self.connection.send(kind, meta, arrays)

    def _held_items(self) -> np.ndarray:
        return live_items(self.held.values())

    def _hello(self, now: float) -> None:
        tokens, arrays = claims(list(self.held.values()))  # each batch's token and its items
        meta = {"model": self.options.model, "epoch": self.registration.epoch or 0}
        sent = self._send(MT.WORKER_HELLO, {**meta, "tokens": tokens}, arrays)
        delay_s = self.registration.said_hello(now)
        if not sent:
            log.debug("broker not reachable; next try in %.2f s", delay_s)

    def _ask(self, now: float) -> None:
        if self.draining or self.broken or now < self.pause_until:
            return
        if self.asking and now - self.ask_sent < 5.0:
            return
        waiting = sum(1 for h in self.held.values() if h.state in ("queued", "running"))
        if waiting >= self.options.prefetch:
            return
        unacknowledged = sum(1 for h in self.held.values() if h.state == "sent")
        if unacknowledged >= MAX_UNACKNOWLEDGED_BATCHES:  # completion is not taking results
            return  # (a full disk, say): no more work until it does, so memory stays bounded
        if self._send(
            MT.WORK_REQUEST,
            {
                "model": self.options.model,
                "max_items": self.options.batch_items,
                "max_tokens": self.token_budget(),
            },
        ):
            self.asking = True
            self.ask_sent = now

    def _report(self, now: float) -> None:
        self.last_report = now
        queued = [b for b, h in self.held.items() if h.state == "queued"]
        self._send(
            MT.REPORT,
            {
                "seen_batch": self.seen_batch,
                "queued": queued,
                # for the broker's metrics (docs/metrics.md): totals since this worker started
                **self.engine_thread.figures(),
                "idle_s": round(self.idle_seconds(now), 3),
            },
            {"held": self._held_items()},
        )

    def _resend(self, now: float) -> None:
        for held in self.held.values():
            if held.state == "sent" and now - held.sent_at > RESEND_S:
                self._send_results(held, now)

    def _handle(self, message: wire.Message, now: float) -> None:
        kind, meta = message.type, message.meta
        if kind == MT.WELCOME:
            self._welcome(message, now)
        elif kind == MT.WORK:
            self.asking = False
            a = message.arrays
            batch_id = int(meta["batch_id"])
            self.seen_batch = max(self.seen_batch, batch_id)
            lane = int(meta["lane"])
            slots = a["slots"]  # whole slots as stored: an 8-word header, then the tokens
            held = Held(
                batch_id,
                np.array(a["items"]),
                np.array(a["lengths"]),
                slots[:, SLOT_HEADER_WORDS : SLOT_HEADER_WORDS + lane],
                str(meta["task"]),
                int(meta.get("max_tokens", 16)),
                meta.get("sampling") if isinstance(meta.get("sampling"), dict) else {},
                token=str(meta.get("token", "")),
                issued=np.array(a["items"]),
            )
            self.held[batch_id] = held
            self.engine_thread.put(held)
            self._ask(now)  # keep the queue full
        elif kind == MT.NO_WORK:
            self.asking = False
            self.pause_until = now + int(meta["retry_ms"]) / 1000
        elif kind == MT.RESULTS_ACK:
            acked = set(meta["result_ids"])
            for batch_id in [b for b, h in self.held.items() if h.result_id in acked]:
                self.completed += len(self.held.pop(batch_id).items)
        elif kind == MT.RESULTS_REFUSED:  # not work this broker's data dir handed out: drop it
            refused = set(meta["result_ids"])
            for batch_id in [b for b, h in self.held.items() if h.result_id in refused]:
                dropped = self.held.pop(batch_id)
                log.error(
                    "the broker refused the results of batch %d (%d item(s)) and they are "
                    "dropped: %s",
                    batch_id,
                    len(dropped.items),
                    meta["reason"],
                )
        elif kind == MT.UNKNOWN_SESSION:
            if self.registration.registered:
                log.warning("the broker does not know this session (it restarted); re-registering")
            self.registration.again(now)
            self.asking = False
        elif kind == MT.PONG:
            pass
        elif kind == MT.ERROR:
            log.error("broker says: %s", meta.get("reason"))
        else:
            log.warning("unexpected %s from the broker ignored", kind.name)

    def _welcome(self, message: wire.Message, now: float) -> None:
        meta = message.meta
        known = message.arrays.get("known", np.zeros(0, np.uint8))
        holding = len(self._held_items())
        # a batch the engine has not started that holds nothing live is skipped (_take_done
        # drops the results of gone items in one it ran)
        for h in mark_gone(list(self.held.values()), known):
            if self.engine_thread.unqueue(h, "dropped"):
                del self.held[h.batch_id]
        self.registration.welcomed(int(meta["epoch"]), float(meta["report_s"]))
        self.seen_batch = 0  # batch ids of this dispatch life are all new
        self.asking = False
        log.info(
            "registered with the broker (epoch %d), holding %d item(s)", meta["epoch"], holding
        )
        for h in self.held.values():
            if h.state == "sent":
                self._send_results(h, now)

    # ---- outcomes from the engine --------------------------------------------------------
    def _take_done(self, now: float) -> None:
        for done in self.engine_thread.outcomes():
            held = self.held.get(done.batch_id)
            if done.outcome == "broken":  # whatever it ran: never hold work it cannot run
                self._fail(held, f"engine failed: {done.reason}", done.reason)
                continue
            if held is None:
                continue
            if done.outcome == "ok":
                arrays = results_message(held.items, held.lengths, done.result)
                if held.gone is not None:  # no longer live since it started: not sent
                    if held.gone.all():
                        del self.held[held.batch_id]
                        continue
                    arrays = keep_results(arrays, ~held.gone)
                    held.items, held.gone = held.items[~held.gone], None
                held.results = ({}, arrays)
                held.engine_s = done.engine_s
                held.tokens = np.zeros((0, 0), np.uint32)
                held.result_id = self.next_result_id
                self.next_result_id += 1
                self.faults.reached("before_send")
                self._send_results(held, now)
                self.faults.reached("before_ack")
            else:  # transient
                self._hand_back([held], f"transient engine failure: {done.reason}", False)
                self.pause_until = now + self.backoff * (0.5 + random.random())
                self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)

    def _watch(self, now: float) -> None:
        """The engine watchdog's verdict, if any, ends this worker: it never holds work it
        cannot run (gpu/worker/watchdog.py)."""
        if self.exit_code is not None:
            return
        waiting = [h.batch_id for h in self.held.values() if h.state in ("queued", "running")]
        verdict = self.watchdog.look(self.engine_thread, waiting, now)
        if verdict is None:
            return
        log.error("%s; handing back what this worker holds and exiting", verdict.reason)
        held = self.held.get(verdict.batch_id) if verdict.batch_id is not None else None
        self._fail(held, verdict.reason, verdict.reason)

    def _fail(self, held: Held | None, reason: str, broken: str) -> None:
        """The engine is broken, hung or gone: hand back its batch (and any batch it was
        running) with an attempt and the rest without, say BYE (nothing waits for this
        session to time out), exit 7."""
        if self.exit_code is not None:
            return
        self.broken = broken
        ran = [h for h in self.held.values() if h is held or h.state == "running"]
        self._hand_back(ran, reason, True)
        queued = [h for h in self.held.values() if self.engine_thread.unqueue(h, "handed_back")]
        self._hand_back(queued, "engine failed; never started", False)
        self._send(MT.BYE, {})
        self.exit_code = exitcodes.FAILED

    def _send_results(self, held: Held, now: float) -> None:
        resent = held.state == "sent"
        held.state = "sent"
        held.sent_at = now
        meta = {
            "result_id": held.result_id,
            "resent": resent,
            "batch_id": held.batch_id,
            "token": held.token,
            "engine_s": round(held.engine_s, 6),  # the job's worker-seconds (docs/wire.md)
        }
        issued = held.items if held.issued is None else held.issued
        if self._send(MT.RESULTS, meta, {**held.results[1], "issued": issued}):
            return
        held.sent_at = now - RESEND_S + 1.0  # not sent: try again in about a second

    def _hand_back(self, batches: list[Held], reason: str, count_attempt: bool) -> None:
        for held in batches:
            self.held.pop(held.batch_id, None)
            held.state = "handed_back"
        if not batches:
            return
        items = np.concatenate([h.live_items() for h in batches])
        self._send(
            MT.HAND_BACK, {"reason": reason, "count_attempt": count_attempt}, {"items": items}
        )
        log.info("handed back %d item(s): %s", len(items), reason)

    # ---- draining: begin_drain, step until drained (or out of time), end_drain -----------
    def begin_drain(self) -> None:
        """Stop asking and hand back what the engine has not started (it skips them)."""
        self.draining = True
        queued = [h for h in self.held.values() if self.engine_thread.unqueue(h, "handed_back")]
        self._hand_back(queued, "worker stopping (SIGTERM)", False)

    @property
    def drained(self) -> bool:
        """Draining, and nothing held: the running batch finished and its results acknowledged."""
        return self.draining and not self.held

    def end_drain(self) -> None:
        """Hand back what is still held (out of grace time) and say BYE."""
        if self.held:
            left = list(self.held.values())
            self._hand_back(left, "worker stopping (SIGTERM): out of grace time", False)
        self._send(MT.BYE, {})
        log.info("worker drained: %d item(s) completed in this session", self.completed)

    def drain(self, deadline: float) -> None:
        """Drain on the host's monotonic clock until `deadline`, as a stage's drain does."""
        self.begin_drain()
        while not self.drained and (now := time.monotonic()) < deadline:
            self.step(now, 20)
        self.end_drain()

    def run(self, stop: Callable[[], bool]) -> int:
        """Loop on the host's monotonic clock until `stop()` or a broken engine; drain; return
        the exit code."""
        while not stop() and self.exit_code is None:
            self.step(time.monotonic())
        if self.exit_code is None:
            self.drain(time.monotonic() + self.options.drain_s)
            return exitcodes.OK
        self.step(time.monotonic(), 0)
        log.error("worker exits: %s", self.broken)
        return self.exit_code


def run_worker(options: WorkerOptions, engine: Engine) -> int:
    """The body of `python run.py worker`: one session until SIGTERM (drain) or engine failure."""
    stopper = StopFlags()
    worker = Worker(options, engine)
    worker.open()
    try:
        return worker.run(lambda: stopper.stop)
    finally:
        worker.close()
