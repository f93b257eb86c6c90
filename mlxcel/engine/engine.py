"""The trio side of the engine: submit requests, receive their events, shut down cleanly."""

from __future__ import annotations

import contextlib
import logging
import math
import queue
from typing import Any

import trio

from ..models.loader import CheckpointInfo
from ..observability import Observability
from .instrument import Instrument
from .messages import Cancel, Inbound, LoadCancelled, Stop, Submit, WorkerSettings
from .requests import Event, Finish, GenerationRequest
from .stopping import Stopping
from .worker import Worker

logger = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine cannot take requests now (still loading, or shutting down)."""


class QueueFull(Exception):
    """Every slot is busy and the wait queue is at its bound."""


class Engine:
    """Owns the worker thread; hands out one event channel per request.

    ``run`` belongs in the server's nursery. Every MLX call happens inside it,
    on one OS thread started with ``trio.to_thread.run_sync`` for the whole life
    of the server. Cancelling ``run`` (test teardown) stops the worker at its
    next step (between prefill chunks, every few tokens of a solo generation,
    between burst rounds) and ends every open request with an error event;
    :meth:`stop` during the model load stops it between load slices.

    The queue bound counts what the worker still holds: a request cancelled by
    its client keeps its place until the worker has let go of it.
    """

    def __init__(self, checkpoint: CheckpointInfo, settings: WorkerSettings, observability: Observability,
                 max_queue_depth: int = 16, instrument: Instrument | None = None) -> None:
        self.checkpoint = checkpoint
        self.settings = settings
        self.observability = observability
        parallel = settings.parallel if settings.batch else 1
        self.capacity = parallel + max_queue_depth
        """Requests that may be in flight at once: decoding plus waiting."""
        self.tokenizer: Any = None
        self.grammar_tokenizer: Any = None
        """llguidance's tokenizer, built at load, or a sentence saying why there is none."""
        self.ready = trio.Event()
        self.finished = trio.Event()
        """Set when the worker has returned (stopped, or failed to load)."""
        self._instrument = instrument
        self._inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        self._channels: dict[str, trio.MemorySendChannel[Event]] = {}
        self._held: set[str] = set()
        """Requests submitted whose Finish has not come back from the worker yet."""
        self._stopping = Stopping()
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        worker = Worker(self.settings, self.checkpoint, self.observability, self._inbox,
                        deliver=self._deliver_from_worker, on_ready=self._ready_from_worker,
                        instrument=self._instrument, stopping=lambda: self._closing)
        try:
            await trio.to_thread.run_sync(worker.run, abandon_on_cancel=False)
        except LoadCancelled:
            logger.info("stopped before the model finished loading")
        except Exception as exc:
            # The model failed to load (or the worker broke): say so where operators look.
            self.observability.state = "failed"
            self.observability.error = str(exc)
            logger.error("the engine stopped: %s", exc)
            logger.debug("where the engine stopped", exc_info=True)  # --log-level debug: the traceback
            raise
        finally:
            self._close()
            self._fail_all("server shutting down")
            self.finished.set()

    def submit(self, request: GenerationRequest) -> trio.MemoryReceiveChannel[Event]:
        """Queue *request*; its events (text deltas, then one Finish) arrive on the channel."""
        if self._closing:
            raise EngineUnavailable("the server is shutting down")
        if not self.ready.is_set():
            raise EngineUnavailable("the model is still loading")
        if len(self._held) >= self.capacity:
            raise QueueFull(f"all {self.capacity} request places are taken")
        if request.id in self._channels:
            raise ValueError(f"duplicate request id {request.id}")
        # Unbounded: the worker must never block on a slow reader; a request's
        # events are bounded by its max_tokens anyway.
        send, receive = trio.open_memory_channel[Event](math.inf)
        self._channels[request.id] = send
        self._held.add(request.id)
        self._inbox.put(Submit(request))
        return receive

    def cancel(self, request_id: str) -> None:
        """Stop generating for *request_id* (a client went away); its slot frees at the next step."""
        if self._channels.pop(request_id, None) is not None:
            self._inbox.put(Cancel(request_id))

    def stop(self, reason: str = "server shutting down") -> None:
        """Ask the worker to end every request with an error event and return."""
        self._close()
        self._inbox.put(Stop(reason))

    def cancelled_on_stop(self) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """A cancel scope that a stop cancels (at once, if the engine is closing already): around a wait whose
        result a stopping server can no longer use (a grammar compile before its submit)."""
        return self._stopping.cancelled()

    @property
    def _closing(self) -> bool:
        return self._stopping.closing

    def _close(self) -> None:
        self._stopping.close()

    # -- called from the worker thread ----------------------------------------

    def _deliver_from_worker(self, events: list[tuple[str, Event]]) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # the server is already gone
            self._token.run_sync_soon(self._dispatch, events)

    def _ready_from_worker(self, tokenizer: Any, grammar_tokenizer: Any) -> None:
        self.tokenizer, self.grammar_tokenizer = tokenizer, grammar_tokenizer
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._became_ready)

    # -- back in trio -------------------------------------------------------------

    def _became_ready(self) -> None:
        # /health and submit flip together, on this thread; a server already stopping stays "stopping".
        if not self._closing:
            self.observability.state = "ready"
        self.ready.set()

    def _dispatch(self, events: list[tuple[str, Event]]) -> None:
        # Runs as a trio system callback: it must never raise.
        for request_id, event in events:
            if isinstance(event, Finish):
                self._held.discard(request_id)
            channel = self._channels.get(request_id)
            if channel is None:
                continue  # cancelled: nobody is listening any more
            try:
                channel.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.cancel(request_id)  # the reader went away before it said so
                continue
            if isinstance(event, Finish):
                del self._channels[request_id]
                channel.close()

    def _fail_all(self, error: str) -> None:
        for request_id, channel in list(self._channels.items()):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                channel.send_nowait(Finish("error", 0, 0, error=error))
            channel.close()
            del self._channels[request_id]
        self._held.clear()
