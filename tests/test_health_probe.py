"""The broker's probe paths on metrics.bind (pipeline/telemetry/health.py): `GET /live` and
`GET /ready`, what a Kubernetes liveness and readiness probe asks (deploy/kubernetes/)."""

from __future__ import annotations

import os
import signal

from broker import Broker, probe, write_config
from conftest import wait_for

from pipeline.telemetry.health import LOOP_STALE_S, Health


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_and_readiness_follow_the_supervisors_phases_and_its_loop():
    clock = FakeClock()
    health = Health(clock)
    assert health.live() == (True, "alive: starting")  # recovery may take minutes: alive
    ready, why = health.ready()
    assert not ready and "starting" in why

    health.turned(["front-0", "dispatch-0"])  # the stages were started, not up yet
    assert health.ready() == (False, "not ready: stage front-0, dispatch-0 not up")
    health.turned([])
    assert health.ready() == (True, "ready")
    assert health.live() == (True, "alive")

    clock.now += LOOP_STALE_S  # a loop that turned LOOP_STALE_S ago is still alive
    assert health.live()[0]
    clock.now += 1.0
    alive, why = health.live()
    assert not alive and f"has not turned for {LOOP_STALE_S + 1:.0f} s" in why
    assert health.ready() == (True, "ready")  # readiness is what the loop said last

    health.turned(["completion-0"])  # a critical stage died: not ready until it is up again
    assert health.live()[0]
    assert health.ready() == (False, "not ready: stage completion-0 not up")

    health.stopping()
    clock.now += 10 * LOOP_STALE_S  # stopping takes up to stop_timeout_s per stage: alive
    assert health.live() == (True, "alive: stopping")
    assert health.ready() == (False, "not ready: stopping")


def test_a_real_broker_answers_ready_unready_while_dispatch_restarts_and_live(tmp_path):
    config = write_config(tmp_path, workers=0)
    text = config.read_text()  # a restart backoff long enough to be seen between two polls
    assert "restart_backoff_s = 0.2" in text
    config.write_text(text.replace("restart_backoff_s = 0.2", "restart_backoff_s = 4.0"))
    broker = Broker(config).start()
    bind = broker.settings.metrics.bind
    try:
        wait_for(lambda: probe(bind, "/ready") == (200, "ready\n"), "/ready to say ready")
        assert probe(bind, "/live") == (200, "alive\n")
        assert "fabric_stage_up" in probe(bind, "/metrics")[1]  # every other path: metrics

        os.kill(broker.pids()["dispatch-0"], signal.SIGKILL)
        wait_for(
            lambda: probe(bind, "/ready") == (503, "not ready: stage dispatch-0 not up\n"),
            "/ready to say dispatch-0 is not up while it waits for its restart",
        )
        assert probe(bind, "/live") == (200, "alive\n")  # the supervisor itself is fine
        wait_for(lambda: probe(bind, "/ready") == (200, "ready\n"), "ready again", timeout_s=30)

        # A frozen supervisor answers nothing: a probe with a timeout fails, as it should.
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            assert probe(bind, "/live", timeout_s=1.0) is None
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        wait_for(lambda: probe(bind, "/live") == (200, "alive\n"), "alive again")
        assert broker.stop() == 0
    finally:
        broker.close()
