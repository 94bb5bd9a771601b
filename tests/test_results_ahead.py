"""Asking ahead: the results client requests the next page while it writes one, and a result is
still marked delivered only once the file holding it is fsynced (invariant 12).

The protocol (collector/delivery_client.py, docs/completion.md "Delivery"): a
FETCH names the pages the client holds (`hold`: received, not acknowledged);
completion leaves their results out of the next page and keeps them
outstanding; the ack of a page goes with the first FETCH after its fsync.
Held here: completion's side in-process (a real stage on a fake clock), the
client's bookkeeping, and a real client process SIGKILLed with two pages out
(one held, one requested), then run again: each line once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import test_dispatch_pipeline
from broker import REPO
from conftest import wait_for
from test_completion_stage import Harness, submit
from test_completion_stage import settings as settings  # the fixture
from test_dispatch_pipeline import (
    assert_each_once,
    fetch,
    finished,
    job_info,
    stop_and_check,
    submit_job,
)

from collector.delivery_client import Delivery
from pipeline import wire

MT = wire.MessageType
broker = test_dispatch_pipeline.broker  # the fixture: a real broker


def rows(page: wire.Message) -> list[int]:
    return page.arrays["index"].tolist()


def test_a_held_page_is_left_out_of_the_next_and_acknowledged_later(settings):
    """Before `hold`, a FETCH without the ack of the page out meant the page was lost: the
    next page was the same results again, so a client could not ask ahead."""
    submit(settings, "job-h", stored=0, rejected=10)  # ten error results, stored at once
    h = Harness(settings)
    try:
        h.step()
        h.step(0.01)
        first = h.ask(MT.FETCH, {"job": "job-h", "limit": 3})
        a = first.meta["page"]
        assert first.meta["ahead"] is True and rows(first) == [0, 1, 2]
        second = h.ask(MT.FETCH, {"job": "job-h", "ack": 0, "hold": [a], "limit": 3})
        b = second.meta["page"]
        assert rows(second) == [3, 4, 5]  # the held page's results are left out
        assert second.meta["undelivered"] == 10  # holding marks nothing
        third = h.ask(MT.FETCH, {"job": "job-h", "ack": a, "hold": [b], "limit": 3})
        assert rows(third) == [6, 7, 8] and third.meta["undelivered"] == 7
        # a client that restarted holds nothing: the pages out are forgotten, sent again
        again = h.ask(MT.FETCH, {"job": "job-h", "ack": 0, "limit": 3})
        assert rows(again) == [3, 4, 5] and again.meta["undelivered"] == 7
        held, seen, ack = again.meta["page"], rows(again), 0
        while True:  # as the client: ask ahead holding a page, ack it with the FETCH after
            page = h.ask(MT.FETCH, {"job": "job-h", "ack": ack, "hold": [held], "limit": 3})
            ack = held  # written and fsynced meanwhile
            if not rows(page):
                break
            seen, held = seen + rows(page), page.meta["page"]
        assert sorted(seen) == list(range(3, 10))  # each once
        last = h.ask(MT.FETCH, {"job": "job-h", "ack": ack, "limit": 3})
        assert rows(last) == [] and last.meta["undelivered"] == 0
        bad = h.ask(MT.FETCH, {"job": "job-h", "hold": 3})
        assert bad.type == MT.ERROR and "hold is 3" in bad.meta["reason"]
    finally:
        h.close()


def test_the_client_holds_a_page_until_durable_and_acks_it_with_the_next_fetch():
    d = Delivery("j", {"limit": 5})
    assert d.counts({"req": d.ask(0.0)["req"], "page": 1, "ahead": True})
    ahead = d.ahead({"page": 1, "ahead": True}, 0.1)  # page 1 arrived, not written yet
    assert ahead == {"job": "j", "ack": 0, "req": 2, "limit": 5, "hold": [1]}
    d.written({"page": 1})
    d.durable(0.2)  # fsynced before the answer to the FETCH ahead is read
    assert d.counts({"req": 2, "page": 2, "ahead": True})
    assert d.ack == 1  # that FETCH did not carry this ack: the next one does
    assert d.ahead({"page": 2, "ahead": True}, 0.3)["ack"] == 1
    assert d.ahead({"page": 3}, 0.4) is None  # an older completion: one page at a time
    everything = Delivery("j", {"all": True})
    everything.counts({"req": everything.ask(0.0)["req"]})
    assert everything.ahead({"page": 0, "cursors": [[1, 9]]}, 0.1)["cursors"] == [[1, 9]]


KILLED_CLIENT = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from collector.delivery.result_file import ResultFile
    from collector.delivery_client import Delivery
    from collector.results_client import ResultsClient

    address, job, out, err, kill_at, when, state = sys.argv[1:]
    deliveries, syncs = [], [0]
    ahead, sync = Delivery.ahead, ResultFile.sync

    def asked(self, page, now):
        deliveries.append(self)
        return ahead(self, page, now)

    def killed(self):
        if self.path == Path(out):
            syncs[0] += 1
            if when == "after":
                sync(self)
            if syncs[0] == int(kill_at):
                d = deliveries[-1]
                Path(state).write_text(json.dumps({"held": d.held, "asked": d.sent_at is not None}))
                os.kill(os.getpid(), signal.SIGKILL)
        sync(self)

    Delivery.ahead, ResultFile.sync = asked, killed
    with ResultsClient(address, 10.0) as client:
        client.fetch(job, out, err, page_items=300)
    """
)


def test_a_client_killed_with_two_pages_out_then_run_again_writes_each_line_once(tmp_path, broker):
    """SIGKILL with one page held (written, before or after its fsync) and the next asked
    for: nothing of either was marked delivered, so the run again writes every line, each
    once. Fails without asking ahead (nothing is ever held)."""
    b = broker(workers=2)
    n = 2000
    for job in ("before", "after"):
        submit_job(b, tmp_path, n, job)
    wait_for(lambda: finished(b, "before") and finished(b, "after"), "both jobs", timeout_s=120)
    for job in ("before", "after"):  # killed before the page's fsync, then right after it
        out, state = tmp_path / f"{job}-out.jsonl", tmp_path / f"{job}.state"
        err = f"{out}.errors.jsonl"
        args = [b.settings.completion.bind, job, str(out), err, "3", job, str(state)]
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_CLIENT, *args],
            cwd=REPO,
            timeout=120,
            text=True,
            capture_output=True,
        )
        assert killed.returncode == -9, killed.stderr
        held = json.loads(state.read_text())
        assert len(held["held"]) == 1 and held["asked"], held  # two pages out: held, asked
        left = n - 2 * 300  # pages 1 and 2 acknowledged, by the FETCH that asked for page 4
        wait_for(lambda j=job, k=left: job_info(b, j)["undelivered"] == k, "the acks")
        rerun = fetch(b, job, out, timeout_s=60)  # liveness: done well within a minute
        assert rerun.returncode == 0, rerun.stderr
        assert_each_once(out, n)
        assert job_info(b, job)["undelivered"] == 0
    stop_and_check(b)
