"""The worker SDK: pull batches ahead, keep the engine busy, return results, lose nothing.

`python run.py worker --broker ADDR --model M --engine E` runs one `Worker`;
the supervisor runs `[workers] local = N` of them as `WorkerStage`s.

Two threads. The engine thread takes batches from a bounded queue and runs
them. The network thread (the caller of `step`) owns the socket and all
state: it registers, asks for work while the queue has room (`prefetch`
batches ahead, so the engine never waits), sends results as they finish and
keeps them until the completion stage has acknowledged them (resending after
a reconnect), reports what it holds every `report_s` (which renews its
leases), and hands back what it cannot do.

| situation                         | what the worker does                                     |
|-----------------------------------|----------------------------------------------------------|
| broker away                       | keeps working through its queue; keeps results; retries with exponential backoff and jitter |
| results not acknowledged (completion away, a full disk) | keeps them and resends every `RESEND_S`; asks for no more work while it holds 32 such batches, so its memory stays bounded |
| broker back (any restart)         | re-registers with the (segment, slot, seq) of all it holds and each batch's work token (invariant 8); drops items the broker says are retired or unknown |
| no answer at all while registering | after `NO_ANSWER_WARN_S` says so once, naming the address: keys are the usual cause |
| RESULTS_REFUSED                   | drops those results: not work this broker's data dir handed out (gpu/dispatch/work_token.py) |
| an item's own error               | that item's error result, at once (invariant 14)           |
| TransientEngineError              | hands the batch back without an attempt; backs off        |
| any other engine failure          | hands back what it holds (the failing batch counting an attempt) and exits 7 |
| a batch running past `batch_timeout_s` | the engine is hung: the same as a failure (the hung batch counts an attempt), exits 7 |
| batches held, none running, for `batch_timeout_s` | the engine is not taking work: the same as a failure, exits 7 |
| the engine thread ended (any cause)   | hands back all it holds (what was running counts an attempt) and exits 7: it never holds work it cannot run |
| re-registered: some held items no longer live | a queued batch with none left is skipped; a running batch is left whole, and results for the items no longer live are dropped when it finishes |
| SIGTERM                           | stops asking; hands back queued batches; finishes the running one within `drain_s`; sends results; waits for their acks; says BYE (invariant 15) |

Every message carries the session id, a fresh random id per process, which
is also the socket identity, so the broker routes replies to this process
only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

from config.defaults import DEFAULTS
from gpu.engines import Engine, EngineBatch, EngineResult, TransientEngineError
from gpu.work_protocol import ITEM_DTYPE
from pipeline import exitcodes, wire
from pipeline.errors import ConfigError, FabricError, WireError
from pipeline.security import ClientCurve, internal_curve, secure_client
from pipeline.segment_format import SLOT_HEADER_WORDS
from pipeline.stage import StopFlags
from pipeline.topology import client_address, worker_group

MT = wire.MessageType
log = logging.getLogger("fabric.worker")
MAX_BACKOFF_S = 5.0
RESEND_S = 10.0  # results unacknowledged this long are sent again
MAX_UNACKNOWLEDGED_BATCHES = 32  # results held for completion past this: the worker stops asking
FAULT_ENV = "FABRIC_WORKER_FAULT"  # tests: "phase[:n]" SIGKILLs this process at that point
PHASES = ("before_compute", "mid_batch", "before_send", "before_ack")
RESULT_KIND_TOKENS, RESULT_KIND_VECTOR, RESULT_KIND_TEXT = 0, 1, 2
WATCH_GAP_S = 1.0  # the watchdog not run this long: the process was stopped; its clock restarts
FIRST_BATCH_TOKENS = 4096  # the first request's token budget, before the engine is measured
NO_ANSWER_WARN_S = 5.0  # registering this long without any answer: say so, and why it may be


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker connects and how much it asks for (defaults: config/defaults.py [workers])."""

    broker: str
    model: str
    heartbeat: str | None = None
    batch_items: int = DEFAULTS["workers"]["batch_items"]
    batch_tokens: int = DEFAULTS["workers"]["batch_tokens"]
    prefetch: int = DEFAULTS["workers"]["prefetch"]
    drain_s: float = DEFAULTS["workers"]["drain_s"]
    target_batch_s: float = DEFAULTS["workers"]["target_batch_s"]
    batch_timeout_s: float = DEFAULTS["workers"]["batch_timeout_s"]  # 0: no watchdog
    curve: ClientCurve | None = None  # CURVE keys for dispatch and heartbeat (pipeline/security.py)


@dataclass(eq=False)
class _Held:
    batch_id: int
    items: np.ndarray  # ITEM_DTYPE
    lengths: np.ndarray
    tokens: np.ndarray
    task: str
    max_tokens: int
    sampling: dict = field(default_factory=dict)
    state: str = "queued"  # queued, running, sent (results out, awaiting ack)
    result_id: int = 0
    results: tuple | None = None  # (meta, arrays) while awaiting the ack
    sent_at: float = 0.0
    token: str = ""  # the work token WORK carried; returned with results and claims
    issued: np.ndarray | None = None  # the items as WORK carried them (the token covers them)
    gone: np.ndarray | None = None  # bool per item: no longer live (said at re-registration)

    def live_items(self) -> np.ndarray:
        """The items it holds that the broker has not said are gone."""
        return self.items if self.gone is None else self.items[~self.gone]


@dataclass
class _Done:
    batch_id: int
    outcome: str  # ok, transient, broken
    result: EngineResult | None = None
    reason: str = ""


def results_message(items: np.ndarray, lengths: np.ndarray, result: EngineResult) -> dict:
    """The RESULTS arrays for one batch: status, kind, prompt tokens and payload per item."""
    n = len(items)
    errors = result.errors
    status = np.zeros(n, np.uint8)
    if result.embeddings is not None:
        vectors = np.ascontiguousarray(result.embeddings, dtype="<f4")
        kind = np.full(n, RESULT_KIND_VECTOR, np.uint8)
        payload = vectors.view(np.uint8).reshape(-1)
        offsets = np.arange(n + 1, dtype=np.int64) * vectors.shape[1] * 4
    else:
        tokens = np.ascontiguousarray(result.tokens, dtype="<u4")
        kind = np.full(n, RESULT_KIND_TOKENS, np.uint8)
        payload = tokens.view(np.uint8)
        offsets = np.asarray(result.offsets, np.int64) * 4
    if any(e is not None for e in errors):
        parts = []
        sizes = []
        for i, error in enumerate(errors):
            if error is None:
                part = payload[offsets[i] : offsets[i + 1]].tobytes()
            else:
                part = error.encode("utf-8")
                status[i], kind[i] = 1, RESULT_KIND_TEXT
            parts.append(part)
            sizes.append(len(part))
        payload = np.frombuffer(b"".join(parts), np.uint8)
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return {
        "items": items,
        "status": status,
        "kind": kind,
        "prompt_tokens": lengths.astype(np.uint32),
        "payload": payload,
        "offsets": offsets,
    }


def keep_results(arrays: dict, keep: np.ndarray) -> dict:
    """The RESULTS arrays of `results_message` for the items where `keep` is True only."""
    offsets = arrays["offsets"]
    starts, ends = offsets[:-1][keep], offsets[1:][keep]
    sizes = ends - starts
    index = np.repeat(starts - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes) + np.arange(
        int(sizes.sum())
    )
    return {
        "items": arrays["items"][keep],
        "status": arrays["status"][keep],
        "kind": arrays["kind"][keep],
        "prompt_tokens": arrays["prompt_tokens"][keep],
        "payload": arrays["payload"][index],
        "offsets": np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
    }


def _item_keys(items: np.ndarray) -> np.ndarray:
    """One u64 per item: (segment, slot); seqs are not compared, the broker checked them."""
    return (items["segment"].astype(np.uint64) << np.uint64(32)) | items["slot"].astype(np.uint64)


def _fault_plan() -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    phase, _, count = spec.partition(":")
    if phase not in PHASES:
        raise FabricError(f"{FAULT_ENV}={spec!r}: phase must be one of {', '.join(PHASES)}")
    return phase, int(count or 1)


class Worker:
    """One worker session. Call `open()`, then `step()` until done, then `close()`."""

    def __init__(
        self, options: WorkerOptions, engine: Engine, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.options = options
        self.engine = engine
        self.session = secrets.token_hex(8)
        self.now = now
        self.held: dict[int, _Held] = {}
        self.ready: queue.Queue[_Held | None] = queue.Queue()
        self.done: queue.Queue[_Done] = queue.Queue()
        self.registered = False
        self.epoch: int | None = None
        self.report_s = 1.0
        self.asking = False
        self.ask_sent = 0.0
        self.next_try = 0.0
        self.backoff = 0.2
        self.hello_sent = 0.0
        self.unanswered_since: float | None = None  # first HELLO since the broker last answered
        self.last_report = 0.0
        self.last_heard = 0.0
        self.next_ping = 0.0
        self.pause_until = 0.0
        self.seen_batch = 0
        self.next_result_id = 1
        self.draining = False
        self.broken: str | None = None
        self.exit_code: int | None = None
        self.completed = 0
        self.tokens_per_s: float | None = None  # the engine's measured speed
        self.idle_s = 0.0
        self._idle_since: float | None = None
        self.prompt_tokens = 0  # of the batches the engine finished (engine thread; reported)
        self.running: tuple[int, float] | None = None  # (batch id, monotonic start): engine thread
        self._claim = threading.Lock()  # a queued batch is started or taken back, never both
        self._stalled_since: float | None = None  # batches held, none running, since then
        self.engine_active = 0.0  # monotonic: the engine thread last started or ended a batch
        self._last_watch = 0.0  # monotonic: the watchdog's last look
        self._fault = _fault_plan()
        self._fault_seen: dict[str, int] = {}

    # ---- lifecycle -----------------------------------------------------------------------
    def open(self) -> None:
        self.engine.load()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.session.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a broker that is not there
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, int(MAX_BACKOFF_S * 1000))
        secure_client(self.socket, self.options.curve)
        self.socket.connect(self.options.broker)
        self.pinger = None
        if self.options.heartbeat:
            self.pinger = self.context.socket(zmq.DEALER)
            self.pinger.setsockopt(zmq.LINGER, 0)
            self.pinger.setsockopt(zmq.SNDTIMEO, 0)
            self.pinger.setsockopt(zmq.IMMEDIATE, 1)
            secure_client(self.pinger, self.options.curve)
            self.pinger.connect(self.options.heartbeat)
        self.thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self.thread.start()
        log.info(
            "worker session %s for model %s on %s (engine %s)",
            self.session,
            self.options.model,
            self.options.broker,
            self.engine.name,
        )

    def close(self) -> None:
        self.ready.put(None)
        self.thread.join(timeout=1.0)
        self.socket.close(0)
        if self.pinger is not None:
            self.pinger.close(0)
        self.context.term()

    # ---- the engine thread ---------------------------------------------------------------
    def _engine_loop(self) -> None:
        while True:
            held = self.ready.get()
            if held is None:
                return
            with self._claim:
                if held.state != "queued":  # handed back or dropped meanwhile
                    continue
                held.state = "running"
                self.engine_active = time.monotonic()
            self._maybe_fault("before_compute")
            batch = EngineBatch(
                held.task, held.tokens, held.lengths, held.max_tokens, held.sampling
            )
            try:
                if self._fault is not None and self._fault[0] == "mid_batch":  # while it runs
                    threading.Timer(0.002, self._maybe_fault, ("mid_batch",)).start()
                began = time.monotonic()
                self.running = (held.batch_id, began)
                result = self.engine.run(batch)
                self.running = None
                self.engine_active = time.monotonic()
                self._measured(held.tokens.size, time.monotonic() - began)
                if len(result.errors) != len(held.items):
                    raise FabricError(
                        f"engine {self.engine.name} returned {len(result.errors)} outcomes "
                        f"for {len(held.items)} items"
                    )
                self.prompt_tokens += int(held.lengths.sum())
                self.done.put(_Done(held.batch_id, "ok", result))
            except TransientEngineError as exc:
                self.running = None
                self.done.put(_Done(held.batch_id, "transient", reason=str(exc)))
            except Exception as exc:  # the engine is broken: never retry against it
                log.exception("engine %s failed", self.engine.name)
                self.done.put(_Done(held.batch_id, "broken", reason=f"{type(exc).__name__}: {exc}"))
                return

    def _measured(self, tokens: int, seconds: float) -> None:
        """The engine's speed in (lane-padded) tokens per second, smoothed over batches."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        self.tokens_per_s = (
            rate if self.tokens_per_s is None else 0.7 * self.tokens_per_s + 0.3 * rate
        )

    def token_budget(self) -> int:
        """Tokens to ask for: what the engine does in about `target_batch_s` (within bounds)."""
        limit = self.options.batch_tokens
        target = self.options.target_batch_s
        if target <= 0:
            return limit
        if self.tokens_per_s is None:  # not measured yet: start small, it grows after a batch
            return min(limit, FIRST_BATCH_TOKENS)
        return max(1, min(limit, int(self.tokens_per_s * target)))

    def _maybe_fault(self, phase: str) -> None:
        if self._fault is None or self._fault[0] != phase:
            return
        seen = self._fault_seen[phase] = self._fault_seen.get(phase, 0) + 1
        if seen >= self._fault[1]:
            log.warning("fault injection: SIGKILL at %s", phase)
            os.kill(os.getpid(), signal.SIGKILL)

    # ---- the network thread --------------------------------------------------------------
    def step(self, timeout_ms: int = 20) -> None:
        now = self.now()
        self._ping(now)
        if not self.registered and now >= self.next_try:
            self._hello(now)
        silent_since = self.unanswered_since
        if (
            not self.registered
            and silent_since is not None
            and now - silent_since >= NO_ANSWER_WARN_S
        ):
            self._no_answer(now)
        self._take_done(now)
        self._watch()
        if self.registered:
            self._ask(now)
            if now - self.last_report >= self.report_s:
                self._report(now)
            self._resend(now)
        try:
            if self.socket.poll(timeout_ms, zmq.POLLIN):
                for _ in range(64):
                    message = wire.recv(self.socket, 0)
                    if message is None:
                        break
                    self.last_heard = self.now()
                    self.unanswered_since = None
                    self._handle(message, self.last_heard)
        except WireError as exc:
            log.warning("malformed message from the broker dropped: %s", exc)
        self._read_pings()
        self._track_idle(now)

    def _track_idle(self, now: float) -> None:
        busy = any(h.state in ("queued", "running") for h in self.held.values())
        if busy or self.draining:
            if self._idle_since is not None:
                self.idle_s += now - self._idle_since
                self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now

    def _send(self, kind: MT, meta: dict, arrays: dict | None = None) -> bool:
        try:
            wire.send(self.socket, kind, {"session": self.session, **meta}, arrays)
            return True
        except FabricError:
            return False

    def _unqueue(self, held: _Held, state: str) -> bool:
        """Take a batch the engine has not started away from it (state `state`); False when
        the engine has started it meanwhile."""
        with self._claim:
            if held.state != "queued":
                return False
            held.state = state
            return True

    def _held_items(self) -> np.ndarray:
        parts = [h.live_items() for h in self.held.values()]
        return np.concatenate(parts) if parts else np.zeros(0, ITEM_DTYPE)

    def _hello(self, now: float) -> None:
        held = list(self.held.values())  # claims: each batch's work token and issued items
        issued = [h.items if h.issued is None else h.issued for h in held]
        sent = self._send(
            MT.WORKER_HELLO,
            {
                "model": self.options.model,
                "epoch": self.epoch or 0,
                "tokens": [
                    [h.batch_id, h.token, len(i)] for h, i in zip(held, issued, strict=True)
                ],
            },
            {
                "held": self._held_items(),
                "issued": np.concatenate(issued) if issued else np.zeros(0, ITEM_DTYPE),
            },
        )
        if self.unanswered_since is None:
            self.unanswered_since = now
        self.hello_sent = now
        delay = self.backoff * (0.5 + random.random())  # jitter: a fleet does not stampede
        self.next_try = now + delay
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)
        if not sent:
            log.debug("broker not reachable; next try in %.2f s", delay)

    def _no_answer(self, now: float) -> None:
        """Registering gets no answer at all: say so once per silence, with the usual causes."""
        seconds = now - self.unanswered_since
        self.unanswered_since = math.inf  # said; the next answer starts a new silence
        if self.options.curve is None:
            keys = (
                "this worker has no key: a broker with keys (security.server_key) answers a "
                "client without one nothing at all; pass --key NAME.key_secret and --server-key "
                "BROKER.key"
            )
        else:
            keys = (
                "the broker answers nothing at all to a key it does not accept: check that this "
                "worker's public key is in the broker's authorized_keys and that --server-key is "
                "the broker's public key"
            )
        log.warning(
            "no answer from the broker at %s for %.0f s; keys are the usual cause (%s); "
            "otherwise the broker is down or the address is wrong (docs/operations.md, Keys and "
            "authentication)",
            self.options.broker,
            seconds,
            keys,
        )

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
        idle_s = self.idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        self._send(
            MT.REPORT,
            {
                "seen_batch": self.seen_batch,
                "queued": queued,
                # for the broker's metrics (docs/metrics.md): totals since this worker started
                "prompt_tokens": self.prompt_tokens,
                "tokens_per_s": round(self.tokens_per_s or 0.0, 1),
                "idle_s": round(max(0.0, idle_s), 3),
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
            held = _Held(
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
            self.ready.put(held)
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
            if self.registered:
                log.warning("the broker does not know this session (it restarted); re-registering")
            self.registered = False
            self.asking = False
            self.next_try = now
        elif kind == MT.PONG:
            pass
        elif kind == MT.ERROR:
            log.error("broker says: %s", meta.get("reason"))
        else:
            log.warning("unexpected %s from the broker ignored", kind.name)

    def _welcome(self, message: wire.Message, now: float) -> None:
        meta = message.meta
        known = message.arrays.get("known", np.zeros(0, np.uint8))
        held = self._held_items()
        if len(known) == len(held) and len(held):
            # Never change a batch under the engine: mark what is gone; a batch the engine
            # has not started and that holds nothing live is skipped; results for gone items
            # are dropped when they come back (_take_done).
            gone = _item_keys(held[known == 0])
            for h in list(self.held.values()):
                drop = np.isin(_item_keys(h.items), gone)
                if not drop.any():
                    continue
                h.gone = drop if h.gone is None else h.gone | drop
                if h.gone.all() and self._unqueue(h, "dropped"):
                    del self.held[h.batch_id]
        if self.epoch is not None and meta["epoch"] != self.epoch:
            log.info("broker restarted (epoch %d -> %d)", self.epoch, meta["epoch"])
        self.epoch = int(meta["epoch"])
        self.seen_batch = 0  # batch ids of this dispatch life are all new
        self.report_s = float(meta["report_s"])
        self.registered = True
        self.backoff = 0.2
        self.asking = False
        log.info("registered with the broker (epoch %d), holding %d item(s)", self.epoch, len(held))
        for h in self.held.values():
            if h.state == "sent":
                self._send_results(h, now)

    def _ping(self, now: float) -> None:
        if self.pinger is None or now < self.next_ping:
            return
        self.next_ping = now + self.report_s
        with contextlib.suppress(FabricError):
            wire.send(self.pinger, MT.PING, {})

    def _read_pings(self) -> None:
        if self.pinger is None:
            return
        while True:
            try:
                message = wire.recv(self.pinger, 0)
            except WireError:
                continue
            if message is None:
                return
            epoch = message.meta.get("epoch")
            if (
                message.type == MT.PONG
                and self.registered
                and self.epoch is not None
                and epoch != self.epoch
            ):
                log.warning("heartbeat: broker epoch changed to %s; re-registering", epoch)
                self.registered = False
                self.next_try = self.now()

    # ---- outcomes from the engine --------------------------------------------------------
    def _take_done(self, now: float) -> None:
        while True:
            try:
                done = self.done.get_nowait()
            except queue.Empty:
                return
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
                held.tokens = np.zeros((0, 0), np.uint32)
                held.result_id = self.next_result_id
                self.next_result_id += 1
                self._maybe_fault("before_send")
                self._send_results(held, now)
                self._maybe_fault("before_ack")
            else:  # transient
                self._hand_back([held], f"transient engine failure: {done.reason}", False)
                self.pause_until = now + self.backoff * (0.5 + random.random())
                self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)

    def _watch(self) -> None:
        """The engine watchdog: an engine thread that ended, a batch running past
        `batch_timeout_s` (a hung engine), or batches held and none running that long (an
        engine that takes no work) each end this worker: it never holds work it cannot run."""
        if self.exit_code is not None:
            return
        if not self.thread.is_alive():
            ended = f"the engine thread of {self.engine.name} ended"
            log.error("%s; handing back what this worker holds and exiting", ended)
            self._fail(None, ended, ended)
            return
        running, limit = self.running, self.options.batch_timeout_s
        if not limit:
            return
        if running is None:
            self._watch_waiting(limit)
            return
        self._stalled_since = None
        batch_id, began = running
        seconds = time.monotonic() - began
        if seconds < limit:
            return
        hung = (
            f"engine {self.engine.name} hung: batch {batch_id} ran {seconds:.0f} s, past "
            f"batch_timeout_s = {limit:g}"
        )
        log.error("%s; handing back what this worker holds and exiting", hung)
        self._fail(self.held.get(batch_id), hung, hung)

    def _watch_waiting(self, limit: float) -> None:
        """Nothing runs: batches waiting for the engine longer than `limit` mean it takes none."""
        now = time.monotonic()
        frozen = now - self._last_watch > min(WATCH_GAP_S, limit / 2)
        self._last_watch = now
        waiting = [h.batch_id for h in self.held.values() if h.state in ("queued", "running")]
        if not waiting:
            self._stalled_since = None
            return
        if self._stalled_since is None or frozen:  # this process itself did not run meanwhile
            self._stalled_since = now  # (SIGSTOP, a starved host): the engine had no chance
        seconds = now - max(self._stalled_since, self.engine_active)
        if seconds < limit:
            return
        stalled = (
            f"engine {self.engine.name} takes no work: batch(es) {waiting[:5]} held {seconds:.0f} s "
            f"with none running, past batch_timeout_s = {limit:g}"
        )
        log.error("%s; handing back what this worker holds and exiting", stalled)
        self._fail(None, stalled, stalled)

    def _fail(self, held: _Held | None, reason: str, broken: str) -> None:
        """The engine is broken, hung or gone: hand back its batch (and any batch it was
        running) with an attempt and the rest without, say BYE (nothing waits for this
        session to time out), exit 7."""
        if self.exit_code is not None:
            return
        self.broken = broken
        ran = [h for h in self.held.values() if h is held or h.state == "running"]
        self._hand_back(ran, reason, True)
        queued = [h for h in self.held.values() if self._unqueue(h, "handed_back")]
        self._hand_back(queued, "engine failed; never started", False)
        self._send(MT.BYE, {})
        self.exit_code = exitcodes.FAILED

    def _send_results(self, held: _Held, now: float) -> None:
        resent = held.state == "sent"
        held.state = "sent"
        held.sent_at = now
        meta = {
            "result_id": held.result_id,
            "resent": resent,
            "batch_id": held.batch_id,
            "token": held.token,
        }
        issued = held.items if held.issued is None else held.issued
        if self._send(MT.RESULTS, meta, {**held.results[1], "issued": issued}):
            return
        held.sent_at = now - RESEND_S + 1.0  # not sent: try again in about a second

    def _hand_back(self, batches: list[_Held], reason: str, count_attempt: bool) -> None:
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

    # ---- draining --------------------------------------------------------------------------
    def drain(self, deadline: float) -> None:
        """Stop asking, hand back what has not started, finish the rest, say goodbye."""
        self.draining = True
        queued = [h for h in self.held.values() if self._unqueue(h, "handed_back")]
        self._hand_back(queued, "worker stopping (SIGTERM)", False)  # the engine skips them
        while self.now() < deadline and self.held:
            self.step(20)
        if self.held:
            left = list(self.held.values())
            self._hand_back(left, "worker stopping (SIGTERM): out of grace time", False)
        self._send(MT.BYE, {})
        log.info("worker drained: %d item(s) completed in this session", self.completed)

    def run(self, stop: Callable[[], bool]) -> int:
        """Loop until `stop()` or a broken engine; drain; return the exit code."""
        while not stop() and self.exit_code is None:
            self.step()
        if self.exit_code is None:
            self.drain(self.now() + self.options.drain_s)
            return exitcodes.OK
        self.step(0)
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


class WorkerStage:
    """A local worker started by the supervisor (`[workers] local = N`, or one of a
    `[[workers]]` table's `count`), run like a stage."""

    name = "worker"

    def __init__(self, settings, index: int) -> None:
        from gpu.engines import make_engine

        self.settings = settings
        self.index = index
        self.workers = workers = worker_group(settings, index)
        model = workers.model or settings.models[0].name
        engine_name = workers.engine or next(
            (m.engine for m in settings.models if m.name == model), "echo"
        )
        options = {}
        if engine_name == "simulated":
            options["tokens_per_s"] = workers.simulated_tokens_per_s
        elif engine_name in ("minilm", "transformers"):  # the cores shared among local workers
            local = sum(group.local for group in settings.worker_groups)
            options["threads"] = max(1, (os.cpu_count() or 1) // max(1, local))
        options.update(workers.options)
        try:
            engine = make_engine(engine_name, **options)
        except TypeError as exc:
            raise ConfigError(
                f"{settings.source}: the local workers of model {model!r} give engine "
                f"{engine_name!r} options {options} it does not take ({exc}); fix their "
                f"options table"
            ) from None
        self.worker = Worker(
            WorkerOptions(
                broker=client_address(settings.dispatch.bind),
                model=model,
                heartbeat=client_address(settings.dispatch.heartbeat_bind),
                batch_items=workers.batch_items,
                batch_tokens=workers.batch_tokens,
                target_batch_s=workers.target_batch_s,
                prefetch=workers.prefetch,
                drain_s=workers.drain_s,
                batch_timeout_s=workers.batch_timeout_s,
                curve=internal_curve(settings),  # a local worker uses the broker's own key
            ),
            engine,
        )

    def open(self) -> None:
        self.worker.open()

    def step(self, now: float) -> None:
        self.worker.step()
        if self.worker.exit_code is not None:
            raise SystemExit(self.worker.exit_code)

    def drain(self, deadline: float) -> None:
        self.worker.drain(time.monotonic() + self.workers.drain_s)

    def close(self) -> None:
        self.worker.close()
