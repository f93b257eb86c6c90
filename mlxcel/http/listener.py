"""The HTTP listener: hypercorn's trio worker, with a bound on open connections.

``hypercorn.trio.serve`` accepts every connection it is offered and has no
limit on how many stay open, so idle keep-alive connections can use every
file descriptor, after which no request is answered (``/health`` included).
This is the same worker (hypercorn's ``TCPServer`` per connection, its
lifespan and graceful shutdown), with its own accept loop:

- at most ``max_connections`` are open; when a new one arrives at the limit,
  the connection idle for longest (between requests, or connected and not yet
  sending one) is closed to make room, which HTTP allows at any time; when
  none is idle, accepting waits until one ends;
- running out of descriptors in ``accept`` closes an idle connection too;
- a request hypercorn's HTTP/1.1 parser (h11) rejects (a tab in the path, a
  malformed header) gets an OpenAI-shaped JSON error body instead of
  hypercorn's empty one;
- hypercorn never closes the socket under an answer still being written, and
  a connection closing on a body it will not read drains it first (a
  "lingering close"), so the client sees the answer rather than a reset;
- a client that takes nothing for ``send_timeout`` while an answer is being
  written (hypercorn's waits for ever) has its connection closed: the app sees
  a disconnect, so a stalled reader's generation is cancelled and its places
  freed, as for a client that went away. The deadline is on progress (each
  16 KiB piece of a write has its own), not on the whole body, so a slow but
  steady reader gets a large answer whole.

It relies on hypercorn 0.18's worker internals: ``TCPServer`` (its
``protocol``/``stream``/``send_lock`` attributes and the ``_read_data`` and
``_close`` methods it overrides), ``H11Protocol`` (``connection``, ``stream``,
``_send_error_response``, ``_send_h11_event``), ``Lifespan``,
``WorkerContext`` and the ``Updated``/``Closed`` events. The tests in
``tests/server/test_connections.py`` and ``test_startup.py`` pin the
behaviour; re-run them on any hypercorn upgrade.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

from .transport import guard_transport

logger = logging.getLogger(__name__)

SEND_PIECE = 16 * 1024
"""Bytes written under one deadline: the send timeout cuts a client that takes less than this in that long
(16 KiB in 30 s: 0.5 KB/s), never one that reads a large answer steadily."""

#: How long a closing connection keeps reading (and dropping) the rest of a body it will not use.
LINGER_SECONDS = 2.0
#: Descriptors kept for everything but connections (model files, the trio wakeup pipe, threads, logs).
RESERVED_FDS = 128
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection (or one that has sent no request yet) stays open."""
    send_timeout: float = 30.0
    """Seconds one write to a client may wait for it to read (its socket buffers full) before the connection
    is closed, and its request cancelled as for a disconnect: a client that never reads would otherwise hold
    its places in the engine for as long as it stays connected."""
    graceful_timeout: float = 5.0
    """Seconds a stopping server's listener waits for open answers to be written before it closes their
    connections (a serving node starts counting once its worker has ended every open request)."""


def connection_limits(args: Any) -> ConnectionLimits:
    """From the parsed ``--max-connections``, ``--keep-alive-timeout`` and ``--send-timeout`` (both roles)."""
    return ConnectionLimits(max_connections=args.max_connections, keep_alive_timeout=args.keep_alive_timeout,
                            send_timeout=args.send_timeout)


class _Connections:
    """Open connections, and since when each has been idle (None: a request is in progress)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle_since: dict[_Connection, float | None] = {}
        self.starting = 0
        """Accepted connections whose task has not run yet: they count against the limit too."""
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def add(self, connection: _Connection) -> None:
        self.idle_since[connection] = trio.current_time()

    def mark(self, connection: _Connection, idle: bool) -> None:
        if connection in self.idle_since:
            self.idle_since[connection] = trio.current_time() if idle else None
            self._notify()

    def remove(self, connection: _Connection) -> None:
        if connection in self.idle_since:
            del self.idle_since[connection]
            self._notify()

    async def evict_one(self) -> bool:
        """Close the connection idle for longest; False when none is idle."""
        idle = [(since, id(c), c) for c, since in self.idle_since.items() if since is not None]
        if not idle:
            return False
        victim = min(idle)[2]
        self.remove(victim)
        await victim.close_idle()
        return True

    async def make_room(self) -> None:
        """Return once a new connection fits: evict idle ones, else wait for one to end."""
        while len(self.idle_since) + self.starting >= self.limit:
            if not await self.evict_one():
                await self._changed.wait()


class _Connection(TCPServer):
    """Hypercorn's per-connection server, reporting idleness to the table and shaping h11's errors."""

    def __init__(self, connections: _Connections, send_timeout: float, *args: Any) -> None:
        super().__init__(*args)
        self._connections = connections
        self._send_timeout = send_timeout
        self._reading = trio.CancelScope()
        self._read_loop_running = False
        self._lingering = False

    async def run(self) -> None:
        self._connections.add(self)
        try:
            await super().run()
        finally:
            self._connections.remove(self)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            await self._send(event.data)
            return
        if isinstance(event, Updated):
            self._connections.mark(self, idle=event.idle)
        elif (isinstance(event, Closed) and self._h11_state("our_state") is h11.SEND_BODY
              and getattr(self.protocol.protocol, "stream", None) is not None):
            # h11 rejected bytes that arrived while the app is still writing its
            # answer (its stream is open; garbage after a body, say). Closing now
            # would break the answer mid-write; hypercorn closes the connection
            # anyway once the answer is done, since the peer is in error. (When the
            # app ends without finishing its answer, hypercorn drops the stream
            # first, and that close goes through.)
            return
        await super().protocol_send(event)

    async def _send(self, data: bytes) -> None:
        """Hypercorn's write (shielded: a write cut short would corrupt the stream), cut when the client makes
        no progress: written in pieces of :data:`SEND_PIECE` bytes, each within the send timeout, so a client
        reading slowly but steadily gets a large answer whole (one write is a whole non-streamed body)."""
        view = memoryview(data)
        async with self.send_lock:
            try:
                for start in range(0, len(view), SEND_PIECE):
                    with trio.CancelScope(shield=True) as scope:
                        scope.deadline = trio.current_time() + self._send_timeout
                        await self.stream.send_all(view[start:start + SEND_PIECE])
                    if scope.cancelled_caught:
                        break
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
        if view and scope.cancelled_caught:
            logger.warning("a client read nothing for %g s (--send-timeout): closing its connection",
                           self._send_timeout)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            await self.protocol.handle(Closed())

    async def _read_data(self) -> None:
        """Hypercorn's read loop, dropping what arrives once it can no longer be a request.

        h11 rejects any bytes after the last request of a connection, and once
        the connection is closing (``_close``) the rest of an unread body is
        not wanted either. Those bytes are read and dropped rather than left
        unread: closing a socket with unread data sends a reset, which can make
        the client lose the answer it has not read yet (a 413, typically).
        """
        protocol = self.protocol.protocol
        if isinstance(protocol, H11Protocol):
            # Hypercorn answers what h11 rejects with an empty body; make it OpenAI-shaped.
            protocol._send_error_response = partial(_send_openai_error, protocol)  # type: ignore[method-assign]
        self._read_loop_running = True
        try:
            with self._reading:
                while True:
                    try:
                        with trio.fail_after(self.config.read_timeout or math.inf):
                            data = await self.stream.receive_some(MAX_RECV)
                    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                        break
                    if not self._lingering and self._h11_state("their_state") not in (h11.MUST_CLOSE, h11.ERROR):
                        await self.protocol.handle(RawData(bytes(data)))
                    if data == b"":
                        break
        finally:
            self._read_loop_running = False
        await self.protocol.handle(Closed())

    def _h11_state(self, side: str) -> object:
        connection = getattr(self.protocol.protocol, "connection", None)
        return getattr(connection, side) if isinstance(connection, h11.Connection) else None

    async def _close(self) -> None:
        # Never close under a write in progress (trio would fail the write as busy),
        # but do close when cancelled (server shutdown) or when a write is stuck.
        if self._read_loop_running and not self._lingering \
                and self._h11_state("their_state") is h11.SEND_BODY:
            # The peer is still sending a body we will not read: say we are done
            # and let the reading task drop what comes until the peer closes, or
            # LINGER_SECONDS, before it closes the socket (see `_read_data`).
            self._lingering = True
            self._reading.deadline = trio.current_time() + LINGER_SECONDS
            with trio.move_on_after(1, shield=True):
                async with self.send_lock:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self.stream.send_eof()
            return
        with trio.move_on_after(1, shield=True):
            async with self.send_lock:
                await super()._close()
        await self.stream.aclose()  # idempotent; closes the socket even when cancelled

    async def close_idle(self) -> None:
        """Close the socket; the connection's own task then sees it closed and ends."""
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


_PROTOCOL_ERRORS = {
    431: ("the request's header fields are too large", "request_header_fields_too_large"),
}


async def _send_openai_error(protocol: H11Protocol, status_code: int) -> None:
    message, code = _PROTOCOL_ERRORS.get(status_code, (
        "the request is not valid HTTP/1.1 (malformed request line, path, header or framing)", "bad_request"))
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *protocol.config.response_headers("h11")]
    await protocol._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await protocol._send_h11_event(h11.Data(data=body))
    await protocol._send_h11_event(h11.EndOfMessage())


def effective_limit(requested: int) -> int:
    """*requested*, lowered to fit the process's open-file limit (with a warning) when it does not."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or requested + RESERVED_FDS <= soft:
        return requested
    fitted = max(1, soft - RESERVED_FDS)
    logger.warning("--max-connections %d does not fit the open-file limit %d; serving at most %d connections",
                   requested, soft, fitted)
    return fitted


async def _accept_loop(listener: trio.SocketListener, connections: _Connections,
                       start: Callable[[trio.SocketStream], Awaitable[None]], nursery: trio.Nursery) -> None:
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _OUT_OF_DESCRIPTORS:
                raise
            if not await connections.evict_one():
                logger.error("accept failed (%s) with no idle connection to close; retrying",
                             errno.errorcode.get(exc.errno or 0, exc))
                await trio.sleep(0.1)
            continue
        try:
            await connections.make_room()
        except BaseException:
            await stream.aclose()  # cancelled while waiting for a place (shutdown)
            raise
        connections.starting += 1  # counted from now: a burst of accepts cannot overshoot the limit
        nursery.start_soon(start, stream)


async def serve(app: Any, *, bind: str, limits: ConnectionLimits, max_body_bytes: int, access_log: bool,
                shutdown: trio.Event, ending: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """``hypercorn.trio.serve`` for plain HTTP on *bind* (``host:port``), with the connection bound, *app* behind
    the transport guard (:mod:`.transport`). Reports the bound URLs. Serves until *shutdown* is set; then awaits
    *ending* (what must end before the graceful period may start: a worker ending every open request) and gives
    the open answers :attr:`ConnectionLimits.graceful_timeout` to be written."""
    config = Config()
    config.bind = [bind]
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handlers, once
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.graceful_timeout = limits.graceful_timeout
    guarded: Any = guard_transport(app, drain_limit=max_body_bytes, drain_seconds=limits.keep_alive_timeout,
                                   stopping=shutdown)  # Any: hypercorn types the ASGI callable by its own events
    asgi = wrap_app(guarded, config.wsgi_max_body_size, "asgi")

    async def shutdown_trigger() -> None:
        await shutdown.wait()
        if ending is not None:
            await ending()

    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    connections = _Connections(effective_limit(limits.max_connections))

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets().insecure_sockets
            listeners = []
            for sock in sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))

            async def start(stream: trio.SocketStream) -> None:
                # No checkpoint from here to the connection's add(): it moves from starting to open at once.
                connections.starting -= 1
                await _Connection(connections, limits.send_timeout, asgi, config, context,
                                  ConnectionState(lifespan_state.copy()), stream)

            task_status.started([f"http://{repr_socket_addr(s.family, s.getsockname())}" for s in sockets])
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    for listener in listeners:
                        nursery.start_soon(_accept_loop, listener, connections, start, server_nursery)
            except BaseExceptionGroup as error:
                _, others = error.split(ShutdownError)
                if others is not None:
                    raise others from None
            finally:
                for listener in listeners:  # refuse new connections while the open ones finish
                    await listener.aclose()
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
