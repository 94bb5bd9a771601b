"""The engine thread: takes queued batches one at a time, runs them, says how each went.

The network thread (`gpu/worker/session.py`) queues batches with `put` and
reads outcomes with `outcomes`; a queued batch is either started here or
taken back there (`unqueue`), never both (`claim`). Each outcome also makes
`wake_fd` readable, so the network thread, waiting on its sockets with that
fd beside them, sends a batch's results and asks for the next one as soon as
the engine is done, not at its next poll timeout.

| outcome     | when                                                            |
|-------------|-----------------------------------------------------------------|
| `ok`        | the engine returned one outcome per item                        |
| `transient` | `TransientEngineError` (out of memory in any engine for one item alone: `Engine.run` halves a batch first): the batch goes back without an attempt |
| `broken`    | anything else: the thread ends, and the worker hands back what it holds and exits 7 |

The thread stamps no time for the watchdog: it counts `turns` (a batch
started or ended) and says what it runs (`running`), and the watchdog times
both on the session's clock (gpu/worker/watchdog.py). Its one clock is
`clock`, which measures how long the engine took over a batch (its speed):
a duration on this thread, where no step's `now` reaches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

from gpu.engines.base import Engine, EngineBatch, TransientEngineError
from gpu.worker.faults import Faults
from gpu.worker.held import Done, Held
from pipeline.core.errors import FabricError

log = logging.getLogger("fabric.worker")


class EngineThread:
    """One engine, run on its own thread (see the module docstring)."""

    def __init__(
        self, engine: Engine, faults: Faults, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.engine = engine
        self.faults = faults
        self.clock = clock  # measures the engine's speed only (see the module docstring)
        self.ready: queue.Queue[Held | None] = queue.Queue()
        self.done: queue.Queue[Done] = queue.Queue()
        self.claim = threading.Lock()  # a queued batch is started or taken back, never both
        self.turns = 0  # batches the thread started, plus those it ended
        self.running: tuple[int, int] | None = None  # (the turn it started on, batch id)
        self.tokens_per_s: float | None = None  # the engine's measured speed
        self.prompt_tokens = 0  # of the batches the engine finished (reported)
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.wake_fd, self._wake_w = os.pipe()  # readable when an outcome is waiting
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    @property
    def name(self) -> str:
        return self.engine.name

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask the thread to end after its batch; wait for it at most `timeout_s`."""
        self.ready.put(None)
        self.thread.join(timeout=timeout_s)

    def close(self) -> None:
        """Release `wake_fd` once nothing polls it (after `stop`); while the thread still
        runs (a hung engine, past `stop`'s wait) it may yet write, so the pipe stays. Then
        close the engine (`Engine.close`: vLLM's engine processes would outlive the worker)."""
        if not self.thread.is_alive() and self.wake_fd >= 0:
            os.close(self.wake_fd)
            os.close(self._wake_w)
            self.wake_fd = self._wake_w = -1
        try:
            self.engine.close()
        except Exception:  # a broken engine may fail to close; the worker exits all the same
            log.exception("engine %s failed to close", self.engine.name)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def put(self, held: Held) -> None:
        self.ready.put(held)

    def unqueue(self, held: Held, state: str) -> bool:
        """Take a batch the engine has not started away from it (state `state`); False when
        the engine has started it meanwhile."""
        with self.claim:
            if held.state != "queued":
                return False
            held.state = state
            return True

    def outcomes(self) -> Iterator[Done]:
        """The outcomes the engine produced since the last call."""
        with contextlib.suppress(BlockingIOError):  # first: a later outcome wakes again
            os.read(self.wake_fd, 4096)
        while True:
            try:
                yield self.done.get_nowait()
            except queue.Empty:
                return

    def measured(self, tokens: int, seconds: float) -> None:
        """The engine's speed in (lane-padded) tokens per second, smoothed over batches."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        self.tokens_per_s = (
            rate if self.tokens_per_s is None else 0.7 * self.tokens_per_s + 0.3 * rate
        )

    def figures(self) -> dict:
        """The REPORT's figures about the engine: prompt tokens, speed, and the engine's own
        (the `openai` engine's concurrency)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens_per_s": round(self.tokens_per_s or 0.0, 1),
            **self.engine.figures(),
        }

    def _tell(self, done: Done) -> None:
        """One outcome for the network thread, which `wake_fd` wakes."""
        self.done.put(done)
        with contextlib.suppress(BlockingIOError):  # full: it is readable already
            os.write(self._wake_w, b"\0")

    def _loop(self) -> None:
        while True:
            held = self.ready.get()
            if held is None:
                return
            with self.claim:
                if held.state != "queued":  # handed back or dropped meanwhile
                    continue
                held.state = "running"
                self.turns += 1
            self.faults.reached("before_compute")
            batch = EngineBatch(
                held.task, held.tokens, held.lengths, held.max_tokens, held.sampling
            )
            try:
                self.faults.during_batch()
                began = self.clock()
                self.running = (self.turns, held.batch_id)
                result = self.engine.run(batch)
                self.running = None
                self.turns += 1
                engine_s = self.clock() - began
                self.measured(held.tokens.size, engine_s)
                if len(result.errors) != len(held.items):
                    raise FabricError(
                        f"engine {self.engine.name} returned {len(result.errors)} outcomes "
                        f"for {len(held.items)} items"
                    )
                self.prompt_tokens += int(held.lengths.sum())
                self._tell(Done(held.batch_id, "ok", result, engine_s=engine_s))
            except TransientEngineError as exc:
                self.running = None
                self.turns += 1
                self._tell(Done(held.batch_id, "transient", reason=str(exc)))
            except Exception as exc:  # the engine is broken: never retry against it
                log.exception("engine %s failed", self.engine.name)
                self._tell(Done(held.batch_id, "broken", reason=f"{type(exc).__name__}: {exc}"))
                return
