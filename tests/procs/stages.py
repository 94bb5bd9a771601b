"""Stages for supervisor tests: one that idles and records its pid (`<data>/pids/<label>`)
and that it drained (`<data>/drained/<label>`), one that waits on a poller a minute at a
time, one that crashes."""

from __future__ import annotations

import os
import threading

import zmq

from pipeline.process.stage import Stage


class IdleStage(Stage):
    name = "idle"

    def open(self) -> None:
        self._wake = threading.Event()
        pids = self.settings.data_path / "pids"
        pids.mkdir(exist_ok=True)
        tmp = pids / f".{self.label}"
        tmp.write_text(str(os.getpid()))
        tmp.rename(pids / self.label)

    def step(self, now: float) -> None:
        self._wake.wait(self.poll_ms / 1000)

    def drain(self, deadline: float) -> None:
        self.log.info("drained idle work")
        drained = self.settings.data_path / "drained"
        drained.mkdir(exist_ok=True)
        (drained / self.label).touch()


class PollingStage(IdleStage):
    """Each step waits a minute on `self.poller`, for a pipe nothing writes to: only the
    signal wake that run_stage adds to the poller can end that wait when SIGTERM comes."""

    name = "polling"

    def open(self) -> None:
        super().open()
        self._read, self._write = os.pipe()
        self.poller = zmq.Poller()
        self.poller.register(self._read, zmq.POLLIN)

    def step(self, now: float) -> None:
        self.poller.poll(60_000)

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class CrashStage(Stage):
    name = "crash"

    def open(self) -> None:
        raise RuntimeError("this stage always fails to open")
