"""The trio side of an embedding model: one OS thread holds the model, requests' inputs share its forwards.

    EmbeddingEngine.run ── trio.to_thread.run_sync(_work): load, then take jobs from the inbox; every job
                           waiting when a forward starts joins it, up to :data:`BATCH_INPUTS` inputs
    EmbeddingEngine.embed ── queue one request's token lists, wait for their vectors

The same face as :class:`mlxcel.engine.Engine` where the fleet and the routes look (``run``, ``ready``,
``finished``, ``stop``); importing this module imports no mlx (the thread does).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from ..engine import EngineUnavailable, QueueFull
from ..engine.stopping import Stopping
from ..observability import Observability
from ..policy import BootFacts, MtpPolicy, PolicySettings
from .checkpoint import EmbeddingModel

logger = logging.getLogger(__name__)

#: Characters of text tokenized on the event loop rather than a thread: tens of microseconds.
INLINE_CHARACTERS = 2048
#: Inputs one round of the thread takes from the queue (of every request waiting, in arrival order).
BATCH_INPUTS = 256


@dataclass
class _Job:
    rows: list[list[int]]
    done: trio.Event = field(default_factory=trio.Event)
    vectors: np.ndarray | None = None
    error: str | None = None
    abandoned: bool = False
    """Its request went away before the thread took it: skipped."""


class EmbeddingEngine:
    """Owns an embedding model's thread; :meth:`embed` is the whole API. ``run`` belongs in a nursery."""

    def __init__(self, model: EmbeddingModel, observability: Observability, policy: PolicySettings,
                 max_queued_inputs: int = 4096) -> None:
        self.model = model
        self.observability = observability
        self.capacity = max_queued_inputs
        """Inputs that may wait or run at once; more is a :class:`QueueFull`."""
        self.tokenizer: Any = None
        self.ready = trio.Event()
        self.finished = trio.Event()
        self._policy = policy
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held = 0
        self._stopping = Stopping()
        self._stop_reason = "server shutting down"
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            await trio.to_thread.run_sync(self._work, abandon_on_cancel=False)
        except Exception as exc:
            self.observability.state, self.observability.error = "failed", str(exc) or type(exc).__name__
            logger.error("the embedding model %s stopped: %s", self.model.name, self.observability.error)
            raise
        finally:
            self._stopping.close()
            self.finished.set()

    def stop(self, reason: str = "server shutting down") -> None:
        """Finish the forward under way, fail what waits with *reason*, and let the thread return."""
        self._stop_reason = reason
        self._stopping.close()
        self._inbox.put(None)

    def cancelled_on_stop(self) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """A cancel scope a stop cancels (at once if stopping already): around a wait a stopping server cannot use."""
        return self._stopping.cancelled()

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """*texts*' tokens (special tokens included): on the event loop when they are short (a thread's round trip
        would cost more than the tokenizing), else on a worker thread (the tokenizer is Rust, not MLX)."""
        if not self.ready.is_set():
            raise EngineUnavailable("the model is still loading")
        if sum(len(text) for text in texts) <= INLINE_CHARACTERS:
            return self._tokenize(texts)
        return await trio.to_thread.run_sync(self._tokenize, texts)

    async def embed(self, rows: list[list[int]]) -> np.ndarray:
        """One float32 vector per token list of *rows*, in order."""
        if self._stopping.closing:
            raise EngineUnavailable("the server is shutting down")
        if not self.ready.is_set():
            raise EngineUnavailable("the model is still loading")
        if self._held + len(rows) > self.capacity:
            raise QueueFull(f"{self._held} inputs are waiting to be embedded (at most {self.capacity})")
        job = _Job(rows)
        self._held += len(rows)
        self._inbox.put(job)
        try:
            await job.done.wait()
        except BaseException:
            job.abandoned = True
            raise
        finally:
            self._held -= len(rows)
        if job.error is not None:
            raise EngineUnavailable(job.error)
        assert job.vectors is not None
        return job.vectors

    # -- the thread -------------------------------------------------------------------

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def _work(self) -> None:
        from ..models.thread_state import released

        with released():  # this thread's compile cache, while the interpreter runs
            self._serve()

    def _serve(self) -> None:
        from ..hardware import detect_host
        from .encoder import Encoder

        encoder = Encoder(self.model.path, self.model.layout, self.model.config)
        snapshot = MtpPolicy(self._policy).on_worker_ready(BootFacts(host=detect_host(), pairing=None))
        self._call_trio(self._became_ready, encoder.tokenizer, snapshot)
        while True:
            job = self._inbox.get()
            if job is None:
                break
            jobs = [job]
            count = len(job.rows)
            while count < BATCH_INPUTS:
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._inbox.put(None)  # stop after this round
                    break
                jobs.append(more)
                count += len(more.rows)
            self._round([j for j in jobs if not j.abandoned], encoder)
        reason = self._stop_reason
        while True:  # what still waits when the stop came
            try:
                left = self._inbox.get_nowait()
            except queue.Empty:
                break
            if left is not None:
                left.error = reason
                self._call_trio(left.done.set)

    def _round(self, jobs: list[_Job], encoder: Any) -> None:
        if not jobs:
            return
        try:
            vectors = encoder.embed([row for job in jobs for row in job.rows])
        except Exception as exc:  # one bad forward fails its requests, not the model
            logger.exception("embedding %d inputs failed", sum(len(job.rows) for job in jobs))
            for job in jobs:
                job.error = f"embedding failed: {exc}"
                self._call_trio(job.done.set)
            return
        start = 0
        for job in jobs:
            job.vectors = vectors[start:start + len(job.rows)]
            start += len(job.rows)
            self._call_trio(job.done.set)

    def _call_trio(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _became_ready(self, tokenizer: Any, snapshot: Any) -> None:
        self.tokenizer = tokenizer
        self.observability.publish_policy(snapshot)
        if not self._stopping.closing:
            self.observability.state = "ready"
        self.ready.set()
