"""A real DispatchStage stepped in-process with a fake clock, for tests (tests/test_dispatch_*).

`SteppedDispatch` opens the production stage on a real data dir (input
segments written with pipeline/store/segment.py) and real sockets: its worker
ROUTER on a loopback port, its inbox and the completion socket on ipc. The
test plays the workers (`FakeWorker`, a DEALER speaking the worker protocol)
and the completion stage (`FakeCompletion`: it takes forwarded RESULTS and
ITEM_ERRORS and answers RETIRED at once, as completion does after its sync).
Time is `SteppedDispatch.now`, passed to `step(now)`: lease, session and
grace timers pass when the test moves it, not on the wall clock.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import zmq
from broker import write_config
from conftest import make_batch

from config import load_settings
from config.stage_settings import stage_settings
from gpu.dispatch.dispatch_stage import DispatchStage
from gpu.work_protocol import ITEM_DTYPE
from pipeline.core import item_seq
from pipeline.store.datadir import DataDir
from pipeline.store.segment import Segment
from pipeline.store.segment_format import KIND_INPUT, SegmentKey, slot_bytes_for
from pipeline.transport import wire
from pipeline.transport.topology import internal_address, run_dir
from pipeline.transport.wire import forwarded

MT = wire.MessageType
LANE = 64
MODEL = "echo"
JOB_NO = 9
FAST = """lease_s = 6.0
session_timeout_s = 2.0
reregister_grace_s = 1.0
report_s = 0.3
max_attempts = 3"""


def input_segment(data_dir: DataDir, segment_id: int, n: int, job_no: int = JOB_NO) -> Segment:
    """An input segment of the `echo` model holding items 0..n-1 of job `job_no`."""
    key = SegmentKey(KIND_INPUT, MODEL, 1, LANE)
    seg = Segment.create(data_dir.segments, segment_id, key, slot_bytes_for(LANE * 4), 4 * n)
    _, _, _, counts, tokens = make_batch(np.random.default_rng(segment_id), n, 1)
    index = np.arange(n, dtype=np.uint32)
    seg.append(item_seq.seq_of(job_no, index), np.full(n, job_no, np.uint64), index, counts, tokens)
    return seg


class FakeWorker:
    """One worker session over a DEALER socket; `max_items` per WORK_REQUEST."""

    def __init__(self, context: zmq.Context, address: str, session: str, max_items: int = 32):
        self.session = session
        self.max_items = max_items
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, session.encode())
        self.socket.connect(address)
        self.result_id = 0

    def send(self, kind: MT, meta: dict | None = None, arrays: dict | None = None) -> None:
        wire.send(self.socket, kind, {"session": self.session, **(meta or {})}, arrays)

    def hello(self, holding: wire.Message | None = None) -> None:
        """Register; `holding`: a WORK message whose items it says it still holds, with the
        batch's work token, as a worker that lived through a restart says them."""
        if holding is None:
            empty = np.zeros(0, ITEM_DTYPE)
            self.send(MT.WORKER_HELLO, {"model": MODEL}, {"held": empty, "issued": empty})
            return
        items, meta = holding.arrays["items"], holding.meta
        tokens = [[meta["batch_id"], meta["token"], len(items)]]
        self.send(
            MT.WORKER_HELLO, {"model": MODEL, "tokens": tokens}, {"held": items, "issued": items}
        )

    def ask(self) -> None:
        meta = {"model": MODEL, "max_items": self.max_items, "max_tokens": 1 << 20}
        self.send(MT.WORK_REQUEST, meta)

    def answer(self, work: wire.Message) -> None:
        """RESULTS for every item of a WORK message: each echoes 4 bytes."""
        items = work.arrays["items"]
        n = len(items)
        self.result_id += 1
        meta = {
            "result_id": self.result_id,
            "batch_id": work.meta["batch_id"],
            "token": work.meta["token"],
        }
        arrays = {
            "items": items,
            "issued": items,
            "status": np.zeros(n, np.uint8),
            "kind": np.zeros(n, np.uint8),
            "prompt_tokens": np.asarray(work.arrays["lengths"], np.uint32),
            "payload": np.zeros(4 * n, np.uint8),
            "offsets": np.arange(n + 1, dtype=np.int64) * 4,
        }
        self.send(MT.RESULTS, meta, arrays)

    def report(self, held: np.ndarray, seen_batch: int) -> None:
        self.send(MT.REPORT, {"seen_batch": seen_batch}, {"held": held})

    def recv(self) -> wire.Message | None:
        return wire.recv(self.socket, 0)

    def close(self) -> None:
        self.socket.close(0)


class FakeCompletion:
    """Takes what dispatch sends completion and retires it at once (RETIRED with the acks)."""

    def __init__(self, context: zmq.Context, settings) -> None:
        self.inbox = context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(internal_address(settings, "completion"))
        self.to_dispatch = context.socket(zmq.PUSH)
        self.to_dispatch.setsockopt(zmq.LINGER, 0)
        self.to_dispatch.connect(internal_address(settings, "dispatch"))
        self.results: Counter = Counter()  # seq -> times received (completion keeps the first)
        self.errors: dict[int, str] = {}  # seq -> reason

    def pump(self) -> int:
        """Take and retire what has arrived; the number of messages."""
        taken = 0
        while (message := forwarded.recv(self.inbox, 0)) is not None:
            taken += 1
            items = message.arrays["items"]
            acks = []
            if message.type == MT.RESULTS:
                self.results.update(items["seq"].tolist())
                acks = [[message.meta["route"], message.meta["result_id"], len(items)]]
            else:
                for seq in items["seq"].tolist():
                    self.errors[seq] = message.meta["reason"]
            wire.send(self.to_dispatch, MT.RETIRED, {"acks": acks}, {"items": items})
        return taken

    def close(self) -> None:
        self.inbox.close(0)
        self.to_dispatch.close(0)


class SteppedDispatch:
    """A real DispatchStage over `tmp_path`, stepped by the test at `self.now`."""

    def __init__(self, tmp_path, dispatch: str = FAST) -> None:
        self.settings = load_settings(write_config(tmp_path, dispatch=dispatch))
        self.data_dir = DataDir(self.settings.data_path).ensure()
        run_dir(self.settings).mkdir(parents=True, exist_ok=True)
        self.context = zmq.Context()
        self.stage: DispatchStage | None = None
        self.completion: FakeCompletion | None = None
        self.workers: list[FakeWorker] = []
        self.now = 0.0
        self._sessions = 0

    def open(self) -> SteppedDispatch:
        """Open the stage (it finds the segments already written) and move past its grace."""
        self.stage = DispatchStage(stage_settings(self.settings, "dispatch"), 0)
        self.stage.open()
        self.now = time.monotonic() + self.settings.dispatch.reregister_grace_s + 0.1
        self.completion = FakeCompletion(self.context, self.settings)
        return self

    def worker(self, max_items: int = 32) -> FakeWorker:
        """A new registered session."""
        self._sessions += 1
        worker = FakeWorker(
            self.context, self.settings.dispatch.bind, f"w-{self._sessions}", max_items
        )
        self.workers.append(worker)
        worker.hello()
        self.until(worker, MT.WELCOME)
        return worker

    def step(self, advance_s: float = 0.0) -> None:
        self.now += advance_s
        self.stage.step(self.now)
        self.completion.pump()

    def until(self, worker: FakeWorker, kind: MT, steps: int = 200) -> wire.Message:
        """Step until `worker` receives a `kind` message (others it gets are dropped)."""
        for _ in range(steps):
            self.step()
            while (message := worker.recv()) is not None:
                if message.type == kind:
                    return message
        raise AssertionError(f"{worker.session} got no {kind.name} in {steps} steps")

    def work(self, worker: FakeWorker) -> wire.Message | None:
        """Ask for work: the WORK message, or None when dispatch answers NO_WORK."""
        worker.ask()
        for _ in range(200):
            self.step(0.05)  # a parked request gets NO_WORK after 0.5 s (of this clock)
            while (message := worker.recv()) is not None:
                if message.type == MT.WORK:
                    return message
                if message.type == MT.NO_WORK:
                    return None
        raise AssertionError(f"{worker.session}: no answer to WORK_REQUEST")

    def broker_info(self) -> dict:
        """The `status` answer, asked over the worker port as `run.py status` asks it."""
        asker = self.context.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        asker.connect(self.settings.dispatch.bind)
        try:
            wire.send(asker, MT.BROKER_STATUS, {})
            for _ in range(200):
                self.step()
                message = wire.recv(asker, 0)
                if message is not None:
                    assert message.type == MT.BROKER_INFO, message.meta
                    return message.meta
            raise AssertionError("no BROKER_INFO")
        finally:
            asker.close(0)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self.completion is not None:
            self.completion.close()
        if self.stage is not None:
            self.stage.close()
        self.context.term()
