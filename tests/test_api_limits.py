"""The HTTP server's own limits (api/http_limits.py), on real sockets against a real broker's
api stage: a request head over `max_header_bytes` is answered 431 at once and not kept in
memory (even without a key, before the 401), a connection past `max_connections` gets 503,
a request head not whole within `request_head_timeout_s` is closed (a half-sent one, one
trickling a byte at a time), an idle keep-alive connection is closed after
`keep_alive_timeout_s`, and the official openai client works within them."""

from __future__ import annotations

import hashlib
import select
import socket
import threading
import time
from pathlib import Path

import openai
import orjson
import pytest
from broker import Broker, free_port, write_config
from conftest import wait_for

KEY = "sk-limits"
HEADER_LIMIT = 16 * 1024
CONNECTIONS = 16
HEAD_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
MIB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A broker with the api stage (keys required) and small limits: (broker, port)."""
    tmp = tmp_path_factory.mktemp("api-limits")
    keys = tmp / "api_keys"
    keys.write_text(f"{hashlib.sha256(KEY.encode()).hexdigest()} team\n")
    port = free_port()
    extra = (
        f'[api]\nenabled = true\nbind = "127.0.0.1:{port}"\nkeys_file = "{keys}"\n'
        f"max_header_bytes = {HEADER_LIMIT}\nmax_connections = {CONNECTIONS}\n"
        f"request_head_timeout_s = {HEAD_TIMEOUT_S}\nkeep_alive_timeout_s = {KEEP_ALIVE_S}\n"
    )
    broker = Broker(write_config(tmp, extra=extra), stderr_path=tmp / "broker.err").start()
    try:
        yield broker, port
    finally:
        broker.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def request(path: str = "/v1/files", key: str | None = KEY, extra: bytes = b"") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + auth + extra + b"\r\n"


def response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response read from `sock`: (status, headers, body; by its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended before a whole response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection ended inside a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def ended(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (its end read; waits up to the socket's timeout)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def error_code(body: bytes) -> str:
    return orjson.loads(body)["error"]["code"]


def test_a_head_over_the_limit_is_431_at_once_and_not_kept_even_without_a_key(served):
    """64 MiB of header was read whole (26 s, the process 64 MiB larger, for good); now the
    answer is 431 before the header's end, without a key too (no 401 after reading it all),
    and the api process grows by nothing like the header's size."""
    broker, port = served
    pid = broker.pids()["api-0"]
    before = rss_bytes(pid)
    for key, size in ((None, 64 * MIB), (KEY, 48 * MIB)):
        sock = connect(port)
        head = request(key=key)[:-2] + b"X-Big: "
        sending = threading.Thread(target=_send_quietly, args=(sock, head, size), daemon=True)
        started = time.monotonic()
        sending.start()
        status, headers, body = response(sock)
        took_s = time.monotonic() - started
        assert (status, headers["connection"]) == (431, "close")
        assert error_code(body) == "request_header_too_large" and took_s < 10
        assert ended(sock)
        sock.close()
        sending.join(30)
    assert rss_bytes(pid) - before < 16 * MIB
    # a head that arrives whole in one read is measured as well; one under the limit is served
    with connect(port) as sock:
        sock.sendall(request(extra=b"X-Long: " + b"b" * HEADER_LIMIT + b"\r\n"))
        assert response(sock)[0] == 431
    with connect(port) as sock:
        sock.sendall(request(extra=b"X-Long: " + b"b" * (HEADER_LIMIT // 2) + b"\r\n"))
        assert response(sock)[0] == 200


def _send_quietly(sock: socket.socket, head: bytes, size: int) -> None:
    """`head`, then `size` bytes of header value, a MiB at a time, until the server stops
    reading (the connection closed)."""
    block = b"a" * MIB
    try:
        sock.sendall(head)
        for _ in range(size // MIB):
            sock.sendall(block)
        sock.sendall(b"\r\n\r\n")
    except OSError:
        pass


def test_a_connection_past_the_limit_is_503_and_the_server_serves_once_below(served):
    _, port = served
    held = [connect(port) for _ in range(CONNECTIONS)]
    try:
        with connect(port) as extra:  # accepted after those, in order
            status, _, body = response(extra)
            assert (status, error_code(body)) == (503, "too_many_connections")
            assert ended(extra)
    finally:
        for sock in held:
            sock.close()

    def served_again() -> bool:
        with connect(port) as sock:
            sock.sendall(request())
            return response(sock)[0] == 200

    wait_for(served_again, "a connection to be served again", timeout_s=30)


def test_half_sent_and_trickling_heads_are_closed_at_the_head_timeout(served):
    """3,000 half-sent requests and clients sending a byte a second stayed open for ever;
    now each is answered 408 and closed once its head is late, trickling or not."""
    _, port = served
    half = connect(port)
    half.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\n")
    trickling = [connect(port) for _ in range(4)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        for byte in request():
            if stop.wait(0.1):
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in trickling]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        for sock in [half, *trickling]:
            status, _, body = response(sock)
            assert (status, error_code(body)) == (408, "request_timeout")
            assert ended(sock)
        took_s = time.monotonic() - started
        assert HEAD_TIMEOUT_S * 0.8 <= took_s < HEAD_TIMEOUT_S + 5
    finally:
        stop.set()
        for sock in [half, *trickling]:
            sock.close()
    with connect(port) as silent:  # one that sends nothing is closed, with nothing to answer
        opened = time.monotonic()
        assert silent.recv(65536) == b""
        assert HEAD_TIMEOUT_S * 0.8 <= time.monotonic() - opened < HEAD_TIMEOUT_S + 5


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(served):
    _, port = served
    with connect(port) as sock:
        for _ in range(3):  # kept open while it is used
            sock.sendall(request())
            assert response(sock)[0] == 200
            # idle, but for less than the timeout: the server must not close it meanwhile
            assert select.select([sock], [], [], KEEP_ALIVE_S / 4)[0] == []
        answered = time.monotonic()
        assert ended(sock)
        idle_s = time.monotonic() - answered
    assert KEEP_ALIVE_S * 0.5 <= idle_s < KEEP_ALIVE_S + 2.5  # uvicorn alone: 5 s


def test_the_openai_client_works_within_the_limits_and_a_nul_id_is_404(served, tmp_path):
    _, port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}
    line["body"] = {"model": "echo", "prompt_token_ids": [1, 2]}
    file = client.files.create(file=("in.jsonl", orjson.dumps(line) + b"\n"), purpose="batch")
    assert client.files.retrieve(file.id).bytes == len(orjson.dumps(line)) + 1
    assert file.id in {f.id for f in client.files.list()}
    for path in ("/v1/files/file-%00x", "/v1/batches/batch_%00x"):
        with connect(port) as sock:
            sock.sendall(request(path))
            status, _, body = response(sock)
            assert status == 404 and orjson.loads(body)["error"]["param"] == "id"
