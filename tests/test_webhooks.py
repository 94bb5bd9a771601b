"""Webhooks of batch ends (collector/webhooks.py, collector/webhook_outbox.py): a loopback receiver checks
every event with the official `openai` client's `webhooks.unwrap()` and counts them by
`webhook-id`; every end status delivers; a receiver answering 500 three times gets the event
on the fourth try with the same id; a kill -9 of the broker while an event is recorded but not
yet delivered still delivers it, with the id it was recorded with; a wrong secret fails; and
the sender's backoff and give-up, stepped on a fake clock."""

from __future__ import annotations

import base64
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import orjson
import pytest
from broker import Broker, free_port, submit, write_config, write_jsonl
from client_commands import run_cli
from conftest import assert_check_clean, wait_for
from test_api_broker import api_broker, bad_file, finish, upload

from api.batch_events import batch_event
from api.batch_record import BatchRecord
from collector.webhook_outbox import DELIVERED, FAILED, PENDING, Outbox, WebhookSender
from collector.webhooks import Webhooks, url_problem
from config import load_settings
from pipeline.core.errors import ConfigError
from pipeline.core.job_states import BatchStatus

SECRET = "whsec_" + base64.b64encode(b"the receiver's own secret, 32 b.").decode()
OTHER = "whsec_" + base64.b64encode(b"somebody else's secret, 32 bytes").decode()


class Receiver:
    """An HTTP server on loopback that verifies each POST with `client.webhooks.unwrap()`:
    `events` counts the verified ones by webhook-id, `refused` the ones that did not verify;
    a path `/fail<N>` answers 500 to the first N tries of each event."""

    def __init__(self, port: int, secret: str = SECRET) -> None:
        self.client = openai.OpenAI(api_key="unused", webhook_secret=secret)
        self.events: Counter[str] = Counter()
        self.bodies: dict[str, dict] = {}
        self.tries: Counter[str] = Counter()
        self.refused = 0
        self.paths: dict[str, set[str]] = defaultdict(set)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                webhook_id = headers.get("webhook-id", "")
                receiver.tries[webhook_id] += 1
                try:
                    event = receiver.client.webhooks.unwrap(body, headers)
                except openai.InvalidWebhookSignatureError:
                    receiver.refused += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                fail = (
                    int(self.path.removeprefix("/fail") or 0)
                    if self.path.startswith("/fail")
                    else 0
                )
                if receiver.tries[webhook_id] <= fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                receiver.events[webhook_id] += 1
                receiver.bodies[webhook_id] = event.model_dump()
                receiver.paths[self.path].add(webhook_id)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def of_batch(self, batch_id: str) -> list[str]:
        return [i for i, body in self.bodies.items() if body["data"]["id"] == batch_id]


def webhooks_config(
    tmp_path: Path, url: str, secret: str = SECRET, give_up_s: float = 600, owner: str = "local"
) -> str:
    secret_file = tmp_path / "whsec"
    secret_file.write_text(secret + "\n")
    return (
        f"webhook_give_up_s = {give_up_s}\n"
        f'[[api.webhooks]]\nowner = "{owner}"\nurl = "{url}/hook"\n'
        f'secret_file = "{secret_file}"\nallow_batch_url = true\n'
    )


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """A broker whose batches' ends go to a verifying receiver; a slow worker (3,000 tokens/s)
    so that a batch can be cancelled or expire while it runs."""
    tmp = tmp_path_factory.mktemp("webhooks")
    receiver = Receiver(free_port())
    keys = 'engine = "simulated"\noptions = {tokens_per_s = 3000.0}'
    broker, url = api_broker(tmp, worker_keys=keys, api_extra=webhooks_config(tmp, receiver.url))
    try:
        yield broker, openai.OpenAI(base_url=url, api_key="any", max_retries=0), receiver
    finally:
        broker.close()
        receiver.close()


def start(client: openai.OpenAI, path: Path, window: str = "24h", **metadata: str):
    return client.batches.create(
        input_file_id=upload(client, path).id,
        endpoint="/v1/embeddings",
        completion_window=window,
        metadata=metadata or None,
    )


def delivered(client: openai.OpenAI, batch_id: str) -> dict | None:
    """The batch's `fabric_webhook` once it says delivered (the sender notes it after the
    receiver's 200)."""
    seen = client.batches.retrieve(batch_id).model_extra.get("fabric_webhook")
    return seen if seen and seen["status"] == DELIVERED else None


def test_every_end_status_delivers_one_verified_event(hooked, tmp_path):
    broker, client, receiver = hooked
    write_jsonl(tmp_path / "small.jsonl", 5)
    write_jsonl(tmp_path / "big.jsonl", 500, seed=5)
    bad_file(tmp_path / "bad.jsonl")
    batches = {
        "completed": start(client, tmp_path / "small.jsonl"),
        "failed": start(client, tmp_path / "bad.jsonl"),
        "cancelled": start(client, tmp_path / "big.jsonl"),
        "expired": start(client, tmp_path / "big.jsonl", window="3s"),
    }
    client.batches.cancel(batches["cancelled"].id)
    for status, batch in batches.items():
        ended = finish(client, batch.id)
        assert ended.status == status, ended
        wait_for(lambda b=batch: receiver.of_batch(b.id), f"the {status} event")
        [event_id] = receiver.of_batch(batch.id)
        event = receiver.bodies[event_id]
        assert event["type"] == f"batch.{status}" and event["object"] == "event"
        assert event["id"] == event_id and event["created_at"] == getattr(ended, f"{status}_at")
        seen = wait_for(lambda b=batch: delivered(client, b.id), "the delivery to be noted")
        assert seen["id"] == event_id and seen["attempts"] == 1, seen
        if status == "completed":  # (the others may end before their job exists)
            info = broker.job_status(batch.id)
            assert info.get("webhook") == seen, info  # `status JOB --json` too
    assert receiver.refused == 0 and set(receiver.paths) == {"/hook"}
    assert max(receiver.events.values()) == 1  # nothing was sent twice
    wait_for(lambda: broker.metric("fabric_webhooks_events", state="delivered") >= 4, "metrics")
    assert broker.metric("fabric_webhooks_attempts_total", outcome="ok") >= 4


def test_a_receiver_answering_500_three_times_gets_the_event_on_the_fourth_try(hooked, tmp_path):
    broker, client, receiver = hooked
    write_jsonl(tmp_path / "small.jsonl", 3)
    batch = start(client, tmp_path / "small.jsonl", fabric_webhook_url=receiver.url + "/fail3")
    assert finish(client, batch.id).status == "completed"
    wait_for(lambda: receiver.of_batch(batch.id), "the event after three 500s", timeout_s=60)
    [event_id] = receiver.of_batch(batch.id)
    assert receiver.tries[event_id] == 4 and receiver.events[event_id] == 1
    assert receiver.paths["/fail3"] == {event_id}  # the batch's own receiver (metadata)
    wait_for(lambda: broker.metric("fabric_webhooks_attempts_total", outcome="error") >= 3, "3")


def test_a_batch_url_is_refused_unless_allowed_and_on_loopback(hooked, tmp_path):
    _, client, _ = hooked
    write_jsonl(tmp_path / "small.jsonl", 3)
    with pytest.raises(openai.BadRequestError, match="beyond loopback"):
        start(client, tmp_path / "small.jsonl", fabric_webhook_url="http://example.com/x")


def test_an_event_recorded_before_a_kill_9_is_delivered_after_it_with_its_id(tmp_path):
    """The receiver is down while the batch ends (the event stays pending); the broker is
    killed with SIGKILL; with the receiver up, the next life sends it with the same id."""
    port = free_port()
    keys = webhooks_config(tmp_path, f"http://127.0.0.1:{port}")
    broker, url = api_broker(tmp_path, api_extra=keys)
    client = openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    receiver = None
    try:
        write_jsonl(tmp_path / "small.jsonl", 5)
        batch = start(client, tmp_path / "small.jsonl")
        assert finish(client, batch.id).status == "completed"
        pending = wait_for(
            lambda: client.batches.retrieve(batch.id).model_extra.get("fabric_webhook"),
            "the event to be recorded",
        )
        assert pending["status"] == PENDING
        broker.kill()
        receiver = Receiver(port)
        broker.start()
        wait_for(lambda: receiver.of_batch(batch.id), "the event after the kill", timeout_s=60)
        assert receiver.of_batch(batch.id) == [pending["id"]]  # once or more, one id
        noted = wait_for(lambda: delivered(client, batch.id), "the delivery to be noted")
        assert noted["id"] == pending["id"]
        broker.stop()
        assert_check_clean(broker.data_dir)
    finally:
        broker.close()
        if receiver is not None:
            receiver.close()


def test_a_cli_job_submitted_with_notify_posts_its_end(tmp_path):
    """`submit --notify URL`: completion POSTs the job's end (the batch event, data.id the job
    id), signed with the secret of the [[api.webhooks]] table of owner `cli`."""
    receiver = Receiver(free_port())
    extra = "[api]\n" + webhooks_config(tmp_path, receiver.url, owner="cli")
    broker = Broker(write_config(tmp_path, extra=extra, workers=1)).start()
    try:
        write_jsonl(tmp_path / "in.jsonl", 20)
        done = submit(broker.config, tmp_path / "in.jsonl", "--notify", receiver.url + "/job")
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.split()[-1]
        wait_for(lambda: receiver.of_batch(job_id), "the job's event", timeout_s=60)
        [event_id] = receiver.of_batch(job_id)
        assert receiver.bodies[event_id]["type"] == "batch.completed"
        assert receiver.paths["/job"] == {event_id} and receiver.refused == 0
        assert broker.job_status(job_id)["state"] == "completed"
        wait_for(lambda: broker.metric("fabric_webhooks_job_events", state="delivered") == 1, "m")
        said = run_cli("status", job_id, "--config", str(broker.config)).stdout
        assert f"webhook    delivered to {receiver.url}/job (1 attempt)" in said
        alone = submit(broker.config, tmp_path / "in.jsonl", "--notify")  # the table's url
        wait_for(lambda: receiver.of_batch(alone.stdout.split()[-1]), "the second job's event")
        far = submit(broker.config, tmp_path / "in.jsonl", "--notify", "http://example.com/x")
        assert far.returncode == 2 and "api.webhook_hosts" in far.stderr
    finally:
        broker.close()
        receiver.close()


# ---- the sender on a fake clock -------------------------------------------------------------
def webhooks_of(tmp_path: Path, secret: str = SECRET, give_up_s: float = 100) -> Webhooks:
    config = tmp_path / "hooks.toml"
    config.write_text(
        "[api]\n" + webhooks_config(tmp_path, "http://127.0.0.1:9", secret, give_up_s)
    )
    return Webhooks(load_settings(config).api)


def ended_batch(status: BatchStatus = BatchStatus.COMPLETED) -> BatchRecord:
    record = BatchRecord("batch_x", "local", "file-x", "/v1/embeddings", "24h", 1000, None)
    record.move_to(status, 1010)
    return record


def test_backoff_doubles_until_a_2xx_and_gives_up_after_the_configured_time(tmp_path):
    answers: list[int] = []
    sent: list[tuple[float, dict]] = []
    clock = [1000.0]

    def send(url, body, headers, timeout_s):
        sent.append((clock[0], headers))
        return answers.pop(0) if answers else 500

    outbox = Outbox(tmp_path)
    sender = WebhookSender(outbox, webhooks_of(tmp_path), send)
    assert outbox.record(batch_event(ended_batch()), "local", "http://127.0.0.1:9/hook", 1000.0)
    assert not outbox.record(batch_event(ended_batch()), "local", "http://x", 1000.0)  # once
    answers[:] = [500, 500, 500, 204]
    while clock[0] < 1020:
        sender.step(clock[0])
        clock[0] += 0.5
    assert [t for t, _ in sent] == [1000.0, 1001.0, 1003.0, 1007.0]  # 1, 2, 4 s apart
    assert len({h["webhook-id"] for _, h in sent}) == 1
    assert sender.events == {PENDING: 0, DELIVERED: 1, FAILED: 0}

    late = BatchRecord("batch_y", "local", "file-y", "/v1/embeddings", "24h", 1000, None)
    late.move_to(BatchStatus.FAILED, 1020)
    outbox.record(batch_event(late), "local", "http://127.0.0.1:9/hook", 1020.0)
    sent.clear()
    while clock[0] < 1400:
        sender.step(clock[0])
        clock[0] += 0.5
    [gone] = [d for d in [outbox.find(h["webhook-id"]) for _, h in sent[:1]] if d]
    assert gone.state == FAILED and gone.ended_at is not None
    assert 1120 <= gone.ended_at < 1120 + 64 + 1  # the first try at or after 100 s
    assert sent[-1][0] == gone.ended_at and outbox.pending() == []
    assert sender.events[FAILED] == 1 and sender.attempts["error"] == 3 + len(sent)


def test_the_signature_verifies_with_openai_and_fails_with_a_wrong_secret(tmp_path):
    captured: list[tuple[bytes, dict]] = []

    def send(url, body, headers, timeout_s):
        captured.append((body, headers))
        return 200

    outbox = Outbox(tmp_path)
    WebhookSender(outbox, webhooks_of(tmp_path), send)
    import time

    now = time.time()
    outbox.record(batch_event(ended_batch(BatchStatus.EXPIRED)), "local", "http://h", now)
    WebhookSender(outbox, webhooks_of(tmp_path), send).step(now)
    [(body, headers)] = captured
    event = openai.OpenAI(api_key="x", webhook_secret=SECRET).webhooks.unwrap(body, headers)
    assert event.type == "batch.expired" and event.data.id == "batch_x"
    assert orjson.loads(body)["created_at"] == 1010
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="x", webhook_secret=OTHER).webhooks.unwrap(body, headers)


def test_receivers_beyond_loopback_and_bad_secrets_are_refused_at_start(tmp_path):
    assert url_problem("http://127.0.0.1:9/x", ()) is None
    assert url_problem("http://[::1]:9/x", ()) is None
    assert "api.webhook_hosts" in url_problem("https://hooks.example.com/x", ())
    assert url_problem("https://hooks.example.com/x", ("hooks.example.com",)) is None
    with pytest.raises(ConfigError, match="does not hold a whsec_"):
        webhooks_of(tmp_path, secret="not a secret")


def test_an_event_recorded_and_never_sent_is_sent_by_the_next_life_with_its_id(tmp_path):
    """Recorded, then the process dies before any POST: a new outbox over the same folder
    (the next life) sends it, with the id it was recorded with."""
    record = ended_batch(BatchStatus.CANCELLED)
    assert Outbox(tmp_path).record(batch_event(record), "local", "http://h", 1000.0)
    sent: list[dict] = []

    def send(url, body, headers, timeout_s):
        sent.append(headers)
        return 200

    after = Outbox(tmp_path)  # the next life: nothing in memory
    WebhookSender(after, webhooks_of(tmp_path), send).step(1000.5)
    assert [h["webhook-id"] for h in sent] == [batch_event(record)["id"]]
    assert after.pending() == [] and after.counts()[DELIVERED] == 1
