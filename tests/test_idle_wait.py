"""pipeline/core/idle_wait.py: an idle loop waits short at first, longer once idle a while, short
again after work."""

from __future__ import annotations

from pipeline.core.idle_wait import IdleWait


def test_the_wait_is_short_until_idle_for_a_while_then_doubles_to_its_cap_and_work_resets_it():
    wait = IdleWait(short_ms=50, long_ms=400, after_s=2.0)
    assert [wait.wait_ms(t) for t in (10.0, 10.5, 11.9)] == [50, 50, 50]
    assert [wait.wait_ms(t) for t in (12.0, 12.1, 12.3, 12.7, 13.1)] == [100, 200, 400, 400, 400]
    wait.busy()
    assert [wait.wait_ms(t) for t in (20.0, 21.0, 22.0)] == [50, 50, 100]
