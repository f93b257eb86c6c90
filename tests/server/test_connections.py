"""Connection-level behaviour, spoken over raw sockets to 127.0.0.1: keep-alive, closing, limits, bad HTTP."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trio
import trio.testing

from tests.server.conftest import open_stream, running_server

KEY = "sekrit"
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def post(path: str, body: bytes, key: str = KEY, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class Connection:
    """A raw HTTP/1.1 client connection that parses Content-Length framed responses."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.closed = False

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stream.aclose()

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some()
        if not chunk:
            self.closed = True
        self.buffer += chunk

    async def response(self) -> tuple[int, dict[str, str], bytes] | None:
        """The next response, or None when the server closed the connection first."""
        while b"\r\n\r\n" not in self.buffer:
            if self.closed:
                assert not self.buffer, f"the connection closed mid-response: {self.buffer!r}"
                return None
            await self._fill()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            assert not self.closed, "the connection closed mid-body"
            await self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    async def closes(self) -> bool:
        """True once the server has closed the connection (after any buffered responses)."""
        while not self.closed:
            await self._fill()
            assert not self.buffer, f"unexpected bytes: {self.buffer!r}"
        return True


async def connect(url: str) -> Connection:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    return Connection(await trio.open_tcp_stream("127.0.0.1", parts.port or 80))


def openai_error(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


EARLY_ANSWERS = {
    # case: (request, status)
    "401 wrong key": (post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}', key="wrong"), 401),
    "405 method": (post("/v1/completions", b'{"prompt": "x"}', method="PUT"), 405),
    "404 path": (post("/v1/nowhere", b'{"prompt": "x"}'), 404),
    "401 chunked body": (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", 401),
}


async def send_split(connection: Connection, request: bytes, then: bytes = b"") -> None:
    """Send *request* in two parts, the server having answered what it could of the first, then *then*.

    Clients often write headers and body separately; an early answer then
    goes out before the body has arrived, which is the case that hung.
    """
    half = request.index(b"\r\n\r\n") + 6
    await connection.stream.send_all(request[:half])
    await trio.testing.wait_all_tasks_blocked()
    await connection.stream.send_all(request[half:] + then)


@pytest.mark.slow
async def test_early_answers_leave_the_connection_usable(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--api-key", KEY, "--keep-alive-timeout", "30"]) as url:
        with trio.fail_after(30):
            for case, (request, status) in EARLY_ANSWERS.items():
                for _ in range(3):
                    # One at a time: the next request on the connection is answered.
                    async with await connect(url) as connection:
                        await send_split(connection, request)
                        answer = await connection.response()
                        assert answer is not None and answer[0] == status, case
                        openai_error(answer[2])
                        await connection.stream.send_all(HEALTH)
                        health = await connection.response()
                        assert health is not None and health[0] == 200, case
                    # Pipelined: both are answered, in order.
                    async with await connect(url) as connection:
                        await send_split(connection, request, then=HEALTH)
                        first, second = await connection.response(), await connection.response()
                        assert first is not None and first[0] == status, case
                        assert second is not None and second[0] == 200, case
                    async with await connect(url) as connection:
                        await connection.stream.send_all(request + HEALTH)
                        first, second = await connection.response(), await connection.response()
                        assert first is not None and first[0] == status, case
                        assert second is not None and second[0] == 200, case


@pytest.mark.slow
async def test_a_body_too_large_is_answered_413_and_the_connection_closed(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--max-body-bytes", "1024",
                               "--keep-alive-timeout", "30"]) as url:
        with trio.fail_after(30):
            for _ in range(5):
                async with await connect(url) as connection:
                    await connection.stream.send_all(post("/v1/completions", b"x" * 8192) + HEALTH)
                    answer = await connection.response()
                    assert answer is not None and answer[0] == 413
                    assert answer[1]["connection"] == "close"
                    assert openai_error(answer[2])["code"] == "request_too_large"
                    assert await connection.closes()


@pytest.mark.slow
async def test_a_client_that_sends_a_whole_large_body_before_reading_still_gets_its_413(llama: Path) -> None:
    # More than the socket buffers hold: unless the server keeps reading after its
    # answer, the writer gets a reset and the reader may never see the 413.
    body = b"x" * (16 * 1024 * 1024)
    async with running_server(["--model", str(llama), "--max-body-bytes", "1024",
                               "--keep-alive-timeout", "30"]) as url, await connect(url) as connection:
        answers: list[tuple[int, dict[str, str], bytes] | None] = []

        async def read() -> None:
            answers.append(await connection.response())
            assert await connection.closes()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                await connection.stream.send_all(post("/v1/completions", body))
        assert answers[0] is not None and answers[0][0] == 413


@pytest.mark.slow
async def test_a_chunked_body_growing_too_large_is_answered_413_and_the_connection_closed(llama: Path) -> None:
    chunk = b"x" * 600
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"258\r\n" + chunk + b"\r\n" for _ in range(4)) + b"0\r\n\r\n")
    async with running_server(["--model", str(llama), "--max-body-bytes", "1024",
                               "--keep-alive-timeout", "30"]) as url, await connect(url) as connection:
        await connection.stream.send_all(request + HEALTH)
        with trio.fail_after(10):
            answer = await connection.response()
            assert answer is not None and answer[0] == 413 and answer[1]["connection"] == "close"
            assert await connection.closes()


@pytest.mark.slow
async def test_an_early_answer_to_a_body_that_never_comes_closes_after_the_keep_alive_timeout(
        llama: Path) -> None:
    async with running_server(["--model", str(llama), "--api-key", KEY, "--keep-alive-timeout", "0.5"]) as url, \
            await connect(url) as connection:
        request = post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}', key="wrong")
        await connection.stream.send_all(request[:-10])  # ten bytes short, and they never come
        started = trio.current_time()
        with trio.fail_after(10):
            answer = await connection.response()
            assert answer is not None and answer[0] == 401 and answer[1]["connection"] == "close"
            assert await connection.closes()
        assert trio.current_time() - started >= 0.4


@pytest.mark.slow
@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
], ids=["connection-close", "http-1.0"])
async def test_connection_close_and_http_1_0_are_honoured(llama: Path, request_bytes: bytes) -> None:
    # A keep-alive timeout far beyond the wait: only honouring the request closes the connection in time.
    async with running_server(["--model", str(llama), "--keep-alive-timeout", "60"]) as url:
        for _ in range(3):
            async with await connect(url) as connection:
                await connection.stream.send_all(request_bytes)
                with trio.fail_after(5):
                    answer = await connection.response()
                    assert answer is not None and answer[0] == 200
                    assert await connection.closes()


@pytest.mark.slow
async def test_idle_connections_are_closed_after_the_keep_alive_timeout(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--keep-alive-timeout", "0.5"]) as url, \
            await connect(url) as served, await connect(url) as silent:
        await served.stream.send_all(HEALTH)
        assert (await served.response() or (0,))[0] == 200
        started = trio.current_time()
        with trio.fail_after(5):
            assert await served.closes()
            assert await silent.closes()  # connected, never sent a request
        assert trio.current_time() - started >= 0.4


@pytest.mark.slow
async def test_many_idle_connections_do_not_starve_health(llama: Path) -> None:
    limit, opened = 40, 200
    async with running_server(["--model", str(llama), "--max-connections", str(limit),
                               "--keep-alive-timeout", "60"]) as url:
        idle: list[Connection] = []
        async with AsyncExitStack() as opened_connections:
            with trio.fail_after(60):
                for _ in range(opened):
                    connection = await opened_connections.enter_async_context(await connect(url))
                    await connection.stream.send_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                    answer = await connection.response()
                    assert answer is not None and answer[0] == 200
                    idle.append(connection)
            with trio.fail_after(2):
                fresh = await opened_connections.enter_async_context(await connect(url))
                await fresh.stream.send_all(HEALTH)
                assert (await fresh.response() or (0,))[0] == 200
            await _assert_at_most_open(idle, limit)


@pytest.mark.slow
async def test_at_the_limit_with_no_idle_connection_a_new_one_waits_for_a_place(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--max-connections", "1",
                               "--keep-alive-timeout", "60"]) as url:
        # A generation in progress holds the only place; it is not idle, so it is not closed.
        busy = await open_stream(url, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4000,
                                                          "stream": True, "temperature": 0})
        async with await connect(url) as waiting:
            await waiting.stream.send_all(HEALTH)
            with trio.move_on_after(0.5) as still_waiting:
                await waiting.response()
            assert still_waiting.cancelled_caught
            await busy.aclose()  # the client goes away: its request and connection end
            with trio.fail_after(10):
                answer = await waiting.response()
            assert answer is not None and answer[0] == 200


async def _assert_at_most_open(connections: list[Connection], limit: int) -> None:

    still_open = 0

    async def check(connection: Connection) -> None:
        nonlocal still_open
        with trio.move_on_after(0.2):
            await connection.closes()
            return
        still_open += 1

    async with trio.open_nursery() as nursery:
        for connection in connections:
            nursery.start_soon(check, connection)
    assert still_open < limit  # the longest-idle ones made room; the fresh connection holds one place


@pytest.mark.slow
@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /he\talth HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    (b"GET /health  HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    (b"GET /health\t HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", 431),
], ids=["tab-in-path", "trailing-space", "trailing-tab", "bad-header", "huge-header"])
async def test_malformed_http_gets_an_openai_shaped_error(llama: Path, request_bytes: bytes, status: int) -> None:
    async with running_server(["--model", str(llama)]) as url, await connect(url) as connection:
        await connection.stream.send_all(request_bytes)
        with trio.fail_after(5):
            answer = await connection.response()
            assert answer is not None and answer[0] == status
            assert answer[1]["content-type"] == "application/json"
            assert openai_error(answer[2])["type"] == "invalid_request_error"
            assert await connection.closes()


async def test_a_client_reading_a_large_answer_slowly_but_steadily_gets_it_whole(
        llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The report's reader at 37 KB/s lost an ``n: 16`` + logprobs answer after 1.3 MB: the send timeout
    covered the whole body, which is one write. It is on progress: a reader that takes some of every piece
    within the timeout is never cut, however long the whole answer takes.

    As large an answer from a chat completion's 20 alternatives a token: 70 tokens a choice, where
    ``logprobs: 5`` took 1,900 (5.7 s of decoding before the first byte, against 1.4 s)."""
    async with running_server(["--model", str(llama), "--send-timeout", "1"]) as url:
        parts = urlsplit(url)
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)  # the kernel buffers little for us
        await sock.connect((parts.hostname, parts.port))
        stream = trio.SocketStream(sock)
        body = json.dumps({"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 70, "n": 16,
                           "logprobs": True, "top_logprobs": 20, "temperature": 1, "seed": 1}).encode()
        await stream.send_all(post("/v1/chat/completions", body, key=""))
        received, started, length = bytearray(), trio.current_time(), None
        with trio.fail_after(120):
            while chunk := await stream.receive_some(4096):
                received += chunk
                if length is None and b"\r\n\r\n" in received:
                    head = bytes(received).partition(b"\r\n\r\n")[0].lower()
                    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                if length is not None and len(received) >= len(head) + 4 + length:
                    break
                await trio.sleep(0.004)  # a few KB a receive (the small buffer): seconds for the whole answer
        await stream.aclose()
    head, _, answer = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert len(answer) > 1_000_000 and trio.current_time() - started > 2, "the answer outlasts the timeout"
    assert len(json.loads(answer)["choices"]) == 16
    assert not any("--send-timeout" in r.getMessage() for r in caplog.records)


async def test_clients_that_never_read_lose_their_places_after_the_send_timeout(
        llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The report's two streams (n=16 and n=4) that never read: once their socket buffers fill, every other
    request was a 503 queue_full for as long as they stayed open. With --send-timeout their connections are
    closed, their generations cancelled, and the server serves again."""
    import httpx

    async with running_server(["--model", str(llama), "--send-timeout", "1"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        parts = urlsplit(url)
        stalled = []
        for n in (16, 4):
            sock = trio.socket.socket()
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)  # a small window fills fast
            await sock.connect((parts.hostname, parts.port))
            stream = trio.SocketStream(sock)
            body = json.dumps({"prompt": "def f(x):", "max_tokens": 1900, "n": n, "stream": True,
                               "logprobs": 5}).encode()
            await stream.send_all(post("/v1/completions", body, key=""))  # never read from here on
            stalled.append(stream)
        quick = {"prompt": "x", "max_tokens": 2}
        with trio.fail_after(30):  # the stalled requests hold every place
            while (await client.post(f"{url}/v1/completions", json=quick)).status_code != 503:
                await trio.sleep(0.1)
        with trio.fail_after(60):  # and lose them once a write has waited a second for its reader
            while (answer := await client.post(f"{url}/v1/completions", json=quick)).status_code == 503:
                assert answer.json()["error"]["code"] == "queue_full"
                await trio.sleep(0.2)
        assert answer.status_code == 200
        assert any("read nothing for 1 s (--send-timeout)" in r.getMessage() for r in caplog.records)
        for stream in stalled:
            await stream.aclose()
