"""Several models behind one port: each loaded model is a whole serving node's app, and this ASGI front
picks one per request.

    Fleet (ASGI) ── POST with a body: its ``model`` picks the model (loaded first if it is not)
                 ── GET /v1/models: every model the catalog holds, loaded or not
                 └─ anything else, and a name no model answers to: the default model's app, which
                    answers it as a lone server would (its 404 lists the models available)

A model's app is :func:`mlxcel.server.create_app` over its own :class:`~mlxcel.engine.Engine`, whose
``run`` is a task of the fleet's nursery: loading one runs on that engine's own thread, so the event
loop and the other models' engines go on meanwhile. Unloading stops the engine (its requests end with
an error event), drops it, and hands its memory back. Which to unload is :mod:`.residency`'s choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import trio

from .. import page
from ..engine.stopping import Stopping
from ..http.app import key_required
from ..http.auth import credential, key_matches
from ..http.errors import ApiError, shutting_down
from ..http.waits import first_of
from ..policy import MtpPolicy, PolicySettings
from ..server.memory import MemoryLedger
from . import asgi
from .asgi import PingedStream, Receive, Scope, Send, lifespan, model_named, replaying, send_error, send_json
from .catalog import Catalog, ModelEntry
from .metrics import fleet_registry, serve_metrics
from .residency import idle_too_long, next_idle_deadline, size, to_unload_for
from .slot import Parts, Slot, release_memory

logger = logging.getLogger(__name__)

#: The routes whose JSON body names the model.
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                          "/v1/responses", "/v1/embeddings"})
#: The policy endpoint, and every status route: ``?model=NAME`` asks for that model's (else the default's).
POLICY = "/v1/internal/mtp-policy"
PER_MODEL = frozenset({POLICY, "/metrics", "/v1/cache/stats", "/v1/internal/server-status", "/props", "/slots"})
#: How long a request waits for its model to load, and for room to load it in, before a 503.
LOAD_WAIT = 600.0

class Fleet:
    """The ASGI app of a server with several models (``--model-dir``, ``--models``). :meth:`run` belongs in the
    server's nursery, before the app takes requests."""

    def __init__(self, catalog: Catalog, build: Callable[[ModelEntry], Parts], *, api_keys: tuple[str, ...],
                 max_body_bytes: int, policy: PolicySettings, max_loaded: int | None = None,
                 idle_unload: float | None = None, blas: str | None = None, budget: int | None = None,
                 metrics: bool = False) -> None:
        self.catalog = catalog
        self.ledger = MemoryLedger(budget) if budget is not None else None
        """What the models are charged and the requests reserve, shared by every model's app."""
        if self.ledger is not None:
            self.ledger.make_room = self._make_room
        self._blas = blas
        self._build = build
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self.max_loaded = max_loaded
        self.slots = {entry.id: Slot(entry, idle_unload) for entry in catalog.entries}
        self._changed = trio.Event()
        """Set (and replaced) whenever a slot's state or business changes: what waiters wait on."""
        self._nursery: trio.Nursery | None = None
        self._not_loaded = MtpPolicy(policy).snapshot.not_loaded().to_wire()
        self._idle_scope = trio.CancelScope()
        self._stopping = Stopping()
        self._started = False
        """Whether the default model's first load has ended, loaded or not: until then ``/health`` is 503."""
        self._metrics = fleet_registry(lambda: list(self.slots.values()), self.ledger) if metrics else None
        """``--metrics``: the fleet's gauges, after the default model's own (:mod:`.metrics`)."""

    # -- lifecycle ----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the default model, unload idle ones when due, and own every engine's task until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._preload, self.default)
            nursery.start_soon(self._unload_when_idle)
            task_status.started()
        # Returns once stopped (:meth:`stop`) and every engine has returned.

    @property
    def default(self) -> Slot:
        return self.slots[self.catalog.default.id]

    def stop(self) -> None:
        """Stop every engine and load nothing more (the server is shutting down): :meth:`run` then returns."""
        self._stopping.close()
        self._idle_scope.cancel()
        for slot in self.slots.values():
            if slot.observability is not None:  # a request the stop ends answers 503, as one model's does
                slot.observability.state = "stopping"
            if slot.engine is not None:
                slot.engine.stop()
        self._notify()

    async def _preload(self, slot: Slot) -> None:
        try:
            await self.ready(slot)
        except ApiError as error:  # said in the log and in /v1/models; the others serve on
            logger.error("%s", error.message)
        finally:
            self._started = True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _start_loading(self, slot: Slot) -> None:
        assert self._nursery is not None and slot.parts is not None, "Fleet.run is not running, or unbuilt"
        slot.state, slot.error, slot.stopped = "loading", None, trio.Event()
        if self.ledger is not None:
            self.ledger.charge(slot.entry.id, slot.parts.charge())
        self._notify()
        self._nursery.start_soon(self._serve_model, slot)

    async def _serve_model(self, slot: Slot) -> None:
        """Build *slot*'s engine and app, run the engine until it stops; a failure fails this model alone."""
        parts, stopped = slot.parts, slot.stopped  # a reload replaces slot.stopped: this run sets its own
        assert parts is not None
        try:
            engine, observability, slot.app = parts.start(slot.entry.id, self._blas, self.ledger)
            if self._stopping.closing:  # stopped since its load began, before :meth:`stop` could see this engine
                engine.stop()
            slot.engine, slot.observability = engine, observability
            logger.info("loading %s (%s)", slot.entry.id, slot.entry.path)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.run)
                await first_of(engine.ready, engine.finished)
                if engine.ready.is_set() and not engine.finished.is_set():
                    slot.state = "loaded"
                    logger.info("%s is loaded", slot.entry.id)
                    self._notify()
        except Exception as exc:  # this model's; every other keeps serving
            said = slot.observability.error if slot.observability is not None else None
            slot.state, slot.error = "failed", said or str(exc) or type(exc).__name__
            logger.error("the model %s failed: %s", slot.entry.id, slot.error)
        finally:
            # Unloading until its memory is back: no request may find it loaded, nor load it again, meanwhile.
            if slot.state != "failed":
                slot.state = "unloading"
            slot.engine = slot.app = slot.observability = None
            if not self._stopping.closing:  # a stopping server's memory goes back with its process
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(release_memory)
            if self.ledger is not None:
                self.ledger.uncharge(slot.entry.id)
            if slot.state != "failed":
                slot.state = "unloaded"
            stopped.set()
            self._notify()

    async def _build_parts(self, slot: Slot) -> None:
        """*slot*'s :class:`ModelParts`, built on a thread (it reads the checkpoint's headers); a failure fails it."""
        async with slot.building:
            if slot.parts is not None or slot.state == "failed":
                return
            try:
                slot.parts = await trio.to_thread.run_sync(self._build, slot.entry)
            except Exception as exc:  # a bad checkpoint or drafter: this model's failure alone
                slot.state, slot.error = "failed", str(exc) or type(exc).__name__
                logger.error("the model %s cannot be served: %s", slot.entry.id, slot.error)
                self._notify()

    async def _unload(self, slot: Slot, why: str) -> None:
        logger.info("unloading %s: %s", slot.entry.id, why)
        slot.state = "unloading"
        self._notify()
        if slot.engine is not None:
            slot.engine.stop(f"the model {slot.entry.id} is being unloaded")
        await slot.stopped.wait()

    async def _make_room(self, count: int) -> None:
        """Unload idle, unpinned models, least recently used first, until *count* more bytes are free (a request's
        reservation did not fit); none when unloading every one of them would not free enough (it waits instead)."""
        residents = [s.resident() for s in self.slots.values() if s.state == "loaded"]
        charged = sum(r.bytes for r in residents)
        for name in to_unload_for(residents, count, charged, None) or ():
            await self._unload(self.slots[name], "making room for a request's cache")

    async def _unload_when_idle(self) -> None:
        with self._idle_scope:
            await self._unload_idle_forever()

    async def _unload_idle_forever(self) -> None:
        while True:
            residents = [s.resident() for s in self.slots.values() if s.state == "loaded"]
            for name in idle_too_long(residents, trio.current_time()):
                await self._unload(self.slots[name], "idle")
            deadline = next_idle_deadline([s.resident() for s in self.slots.values() if s.state == "loaded"])
            with trio.move_on_at(deadline if deadline is not None else trio.current_time() + 3600):
                await self._changed.wait()

    async def ready(self, slot: Slot) -> Any:
        """*slot*'s app once it is loaded, loading it (and unloading others to make room) if it is not; an
        :class:`ApiError` when it failed to load or no room came within :data:`LOAD_WAIT`."""
        slot.busy += 1  # waiting for its load, it is in use: nothing unloads it meanwhile
        try:
            with trio.move_on_after(LOAD_WAIT):
                while True:
                    if self._stopping.closing:
                        raise shutting_down()
                    if slot.state == "loaded":
                        return slot.app
                    if slot.state == "failed":
                        raise ApiError(500, f"the model {slot.entry.id!r} failed to load: {slot.error}",
                                       type="server_error", code="model_load_failed")
                    if slot.state == "unloaded" and slot.parts is None:
                        await self._build_parts(slot)
                        continue
                    if slot.state == "unloaded":
                        need = slot.parts.charge() if slot.parts is not None else 0
                        budget = self.ledger.budget if self.ledger is not None else None
                        if budget is not None and need > budget:
                            raise ApiError(503, f"the model {slot.entry.id!r} needs {size(need)} (weights, drafter, "
                                                f"prefix cache bound), more than the memory budget of "
                                                f"{size(budget)} (--memory-budget, --prompt-cache-bytes)",
                                           type="server_error", code="model_too_large")
                        others = [s.resident() for s in self.slots.values()
                                  if s is not slot and s.state in ("loading", "loaded", "unloading")]
                        # The requests in flight keep their reservations: the models' charges make room around them.
                        reserved = self.ledger.reserved if self.ledger is not None else 0
                        unload = to_unload_for(others, need + reserved, budget, self.max_loaded)
                        if unload == []:
                            self._start_loading(slot)
                            continue
                        for name in unload or ():
                            await self._unload(self.slots[name], f"making room for {slot.entry.id}")
                        if unload is not None:
                            continue
                    await self._changed.wait()
            raise ApiError(503, f"the model {slot.entry.id!r} did not become available within {LOAD_WAIT:.0f} s "
                                f"(the models loaded are busy or pinned)", type="server_error",
                           code="model_unavailable")
        finally:
            slot.busy -= 1
            slot.last_used = trio.current_time()

    # -- ASGI ---------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self._to_default(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/v1/models" and self._authorized(scope):
            await send_json(send, 200, {"object": "list", "data": [s.describe() for s in self.slots.values()]})
            return
        if method == "GET" and path.startswith("/v1/models/") and self._authorized(scope):
            named = self._slot_for(path.removeprefix("/v1/models/"))
            if named is not None:
                await send_json(send, 200, named.describe())
                return
        if method == "GET" and path in PER_MODEL and self._authorized(scope):
            name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
            if name is not None:
                await self._status_of(name, scope, receive, send)
                return
        if method == "GET" and path == "/metrics" and self._metrics is not None and self._authorized(scope):
            await serve_metrics(self.default.app, self._metrics, scope, receive, send)
            return
        if method == "GET" and path in ("/health", "/v1/health"):
            await self._health(send)
            return
        if method == "GET" and (found := page.answer(path, asgi.header(scope, "accept"))) is not None:
            await page.send_answer(send, found)  # here, not by the default model's app: showing it loads no model
            return
        if method == "POST" and path in MODEL_ROUTES and self._authorized(scope):
            read = await asgi.read_body_unless_stopped(scope, receive, send, self._max_body_bytes, self._stopping)
            if read is None:
                return
            messages, complete = read
            replay = replaying(messages, receive)
            body = b"".join(m.get("body", b"") for m in messages)
            model, streamed = await model_named(body) if complete else (None, False)
            slot = self._slot_for(model) if complete else None
            if slot is not None:
                if streamed and slot.state != "loaded":
                    await self._forward_with_pings(slot, scope, replay, send)
                else:
                    await self._forward(slot, scope, replay, send)
                return
            await self._to_default(scope, replay, send)
            return
        await self._to_default(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """Whether the request carries an accepted key (or none is needed): the front answers or loads only then;
        else the default model's app answers, with its 401."""
        if not self._api_keys:
            return True
        presented = credential(asgi.header(scope, "authorization"), asgi.header(scope, "x-api-key"))
        return key_matches(presented, self._api_keys)

    async def _health(self, send: Send) -> None:
        """Public, as a lone server's: 503 ``loading`` until the default model first loads, else 200 ``ok`` (a
        model unloaded, or one that failed, is no reason to call the server down: it loads on demand), with every
        model's state and the default model's policy and BLAS while it is loaded."""
        default = self.default
        status = "ok" if self._started else "loading"
        body: dict[str, Any] = {"status": status, "model": default.entry.id,
                                "models": [s.describe() for s in self.slots.values()]}
        if self.ledger is not None:
            body["memory"] = self.ledger.to_json()
        if default.observability is not None:
            if status == "loading" and default.observability.loading is not None:
                body["loading"] = default.observability.loading  # what the start is doing: its last progress line
            body["observability"] = {"mtp_policy": default.observability.policy.to_health(),
                                     "blas": default.observability.blas}
        await send_json(send, 503 if status == "loading" else 200, body)

    async def _status_of(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A status route with ``?model=NAME``: that model's app answers while it is loaded or loading; for a
        model not loaded, the policy endpoint is a well-formed body (``unavailable/not_loaded``) and the others a
        503 ``model_not_loaded``; nothing is loaded to answer."""
        slot = self._slot_for(name)
        if slot is None:
            served = ", ".join(repr(i) for i in self.catalog.ids())
            await send_error(send, scope, ApiError(
                404, f"the model {name!r} does not exist; this server serves {served}", param="model",
                code="model_not_found"))
        elif slot.app is not None:
            await slot.app(scope, receive, send)
        elif scope["path"] == POLICY:
            await send_json(send, 200, self._not_loaded)
        else:
            await send_error(send, scope, ApiError(503, f"the model {slot.entry.id!r} is not loaded: its figures exist "
                                                    f"while it is", type="server_error", code="model_not_loaded"))

    def _slot_for(self, name: str | None) -> Slot | None:
        entry = self.catalog.resolve(name)
        return self.slots[entry.id] if entry is not None else None

    async def _forward(self, slot: Slot, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            app = await self.ready(slot)
        except ApiError as error:
            await send_error(send, scope, error)
            return
        await self._answer(slot, app, scope, receive, send)

    async def _forward_with_pings(self, slot: Slot, scope: Scope, receive: Receive, send: Send) -> None:
        """A stream for a model that is not loaded: if the load outlasts :data:`PING_AFTER`, the stream's head is
        sent then and a keep-alive every :data:`PING_EVERY` (Anthropic's ``ping`` event on its routes, an SSE
        comment elsewhere), so that a client's read timeout does not fire while it waits; once loaded, the app's
        answer follows in that stream (an error it answers with, as the route's error event)."""
        stream = PingedStream(send, scope["path"].startswith("/v1/messages"))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.ping_while_waiting)
                try:
                    app = await self.ready(slot)
                finally:
                    nursery.cancel_scope.cancel()
        except ApiError as error:
            await (stream.fail(error) if stream.started else send_error(send, scope, error))
            return
        await self._answer(slot, app, scope, receive, stream.send if stream.started else send)

    async def _answer(self, slot: Slot, app: Any, scope: Scope, receive: Receive, send: Send) -> None:
        slot.busy += 1
        try:
            await app(scope, receive, send)
        finally:
            slot.busy -= 1
            slot.last_used = trio.current_time()
            self._notify()

    async def _to_default(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The default model's app answers: at once while it loads or is loaded (a loading one answers as a lone
        server's does), else after loading it again; a request without an accepted key is refused here then,
        rather than load a model to refuse it."""
        app = self.default.app
        if app is not None or scope["type"] != "http":
            if app is not None:
                await app(scope, receive, send)
            return
        if not self._authorized(scope):
            await send_error(send, scope, key_required())
            return
        await self._forward(self.default, scope, receive, send)
