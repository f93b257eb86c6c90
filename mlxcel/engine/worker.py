"""The engine's worker: one OS thread that makes every MLX call of the server.

MLX streams are bound to the thread that creates them, so the worker loads the
model, owns the caches, the continuous-batching generator and the MTP policy,
and runs the decode loop, all on this one thread for the life of the server.
It talks to the trio side through a thread-safe inbox (requests, cancellations,
stop) and hands events back with ``TrioToken.run_sync_soon``, which never
blocks: the decode loop never waits on the HTTP side.

Faults are isolated per request: an exception while serving a sequence ends
that request with an error and frees it; a failure of the batch step fails
the sequences in it and rebuilds the batch. Serving goes on either way.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from ..models.loader import CheckpointInfo
from ..observability import ModelLimits, Observability
from ..policy import BootFacts, HintStore, MtpPolicy
from .admission import Admission
from .batch import ContinuousBatch
from .messages import LoadCancelled, Message, WorkerSettings
from .requests import ErrorType, Event, Finish, FinishReason, GenerationRequest
from .sequence import Sequence

if TYPE_CHECKING:  # the worker imports mlx on its own thread, not at import time
    from .solo import SoloDecoder
    from .speculation import Speculation

logger = logging.getLogger(__name__)

#: A decoding solo sequence checks for cancellation of the whole engine every this many tokens.
CANCEL_CHECK_TOKENS = 16

class Worker(Admission):
    """Owns MLX for the server. :meth:`run` is the thread's whole life."""

    def __init__(self, settings: WorkerSettings, checkpoint: CheckpointInfo, observability: Observability,
                 inbox: queue.SimpleQueue[Message], deliver: Callable[[list[tuple[str, Event]]], None],
                 on_ready: Callable[[Any, Any], None], before_load: Callable[[], None] | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.observability = observability
        self.inbox = inbox
        self._deliver = deliver
        self._on_ready = on_ready
        self._before_load = before_load
        self._stopping = stopping
        hints = HintStore(settings.cache_root) if settings.cache_root is not None else None
        self.policy = MtpPolicy(settings.policy, hints, publish=observability.publish_policy)
        self.model: Any = None
        self.tokenizer: Any = None
        self.stream: Any = None
        self.eos_tokens: frozenset[int] = frozenset()
        self.speculation: Speculation | None = None
        self.batch: ContinuousBatch[Sequence] | None = None  # when batching
        self.prefix: Any = None
        self.sharded = False
        self._parallel = 1
        self._sequences: dict[str, Sequence] = {}
        self._release: Callable[[], None] = lambda: None  # what the loaded model needs when the worker ends

    # -- the thread -------------------------------------------------------------

    def run(self) -> None:
        try:
            self._load()
        except LoadCancelled:
            raise  # a stop, not a failure: the state stays "stopping"
        except BaseException:
            self.observability.state = "failed"
            raise
        try:
            self._loop()
        finally:
            self.policy.on_worker_lost()
            if self.batch is not None:
                self.batch.close()
            self._release()

    def _check_stopping(self) -> None:
        if self._stopping():
            raise LoadCancelled("stopped while loading the model")

    def _load(self) -> None:
        from .loading import load
        from .prefix_cache import PrefixCache

        if self._before_load is not None:
            self._before_load()
        loaded = load(self.settings, self.checkpoint, self._check_stopping)
        self.model, self.tokenizer, self.stream = loaded.model, loaded.tokenizer, loaded.stream
        self.eos_tokens, self.speculation = loaded.eos_tokens, loaded.speculation
        self._parallel, self._release, self.sharded = loaded.parallel, loaded.release, loaded.sharded
        if loaded.batching:
            self.batch = ContinuousBatch(self.model, self.eos_tokens, self._parallel,
                                         self.settings.prefill_step_size, self.stream)
        self.prefix = PrefixCache(str(self.checkpoint.path), self.settings.prefix_cache_entries,
                                  self.checkpoint.model_type, max_bytes=self.settings.prefix_cache_bytes)
        self._publish_load()
        speculation = self.speculation
        self.policy.on_worker_ready(BootFacts(host=loaded.host, pairing=loaded.pairing,
                                              probe_decline=speculation.decline if speculation else None,
                                              sharded=loaded.sharded))
        if speculation is not None and speculation.decline is not None and self.policy.state != "exactness_declined":
            # The policy logs a veto itself only when it declines: a pin or adaptive-off hides it.
            logger.warning("MTP exactness probe vetoed the burst (MTP is %s, so no burst will run): %s",
                           self.policy.state, speculation.decline)
        self.observability.limits = ModelLimits(vocab_size=loaded.vocab, embedding_size=loaded.embedding_rows,
                                                context_length=self.checkpoint.context_length)
        self._on_ready(self.tokenizer, loaded.grammar_tokenizer)

    def _fault(self, point: str, request: GenerationRequest) -> None:
        if self.settings.fault_hook is not None:
            self.settings.fault_hook(point, request)

    def _burst_allowed(self, request: GenerationRequest) -> bool:
        """The runtime gates of the B=1 burst, below the policy's live gate."""
        # Logprobs come from classic decode. Logits processors (bias, penalties, a grammar) do not gate:
        # the burst applies them at every verify position.
        return bool(self.policy.mtp_enabled) and not request.logprobs

    def _loop(self) -> None:
        while True:
            if not self._take_messages(block=not self._sequences):
                return
            trio.from_thread.check_cancelled()
            solo = self._solo_candidate()
            if solo is not None:
                try:
                    self._advance_solo(solo)
                except Exception as exc:
                    self._fail([solo], exc)
            elif self._sequences and self.batch is not None:
                try:
                    self._batch_step(self.batch)
                except Exception as exc:
                    self._fail(self.batch.sequences, exc)
                    self._rebuild_batch()

    def _rebuild_batch(self) -> None:
        assert self.batch is not None
        try:
            self.batch.rebuild()
        except Exception as exc:  # no batch to be had: serve on, one sequence at a time
            logger.error("the continuous batch could not be rebuilt (%s: %s): serving one sequence at a time",
                         type(exc).__name__, exc)
            self.batch, self._parallel = None, 1

    def _fail(self, sequences: list[Sequence], exc: Exception) -> None:
        """End *sequences* with an error (their caches are dropped, not reused); serving goes on."""
        from .grammar import GrammarError  # here: grammar.py imports mlx, which a router never loads

        events: list[tuple[str, Event]] = []
        grammar = isinstance(exc, GrammarError)  # the request's own grammar: a 400, not the server's fault
        for sequence in sequences:
            logger.error("request %s failed: %s: %s", sequence.request.id, type(exc).__name__, exc)
            self._forget(sequence)
            message = f"the response's grammar cannot be followed: {exc}" if grammar \
                else f"generation failed: {type(exc).__name__}: {exc}"
            events.append((sequence.request.id, self._finish(sequence, "error", message,
                                                             "invalid_request_error" if grammar else "server_error")))
        self._publish_load()
        self._deliver(events)

    def _solo_candidate(self) -> Sequence | None:
        """The sequence to decode alone now, if any: batching, the only one if it started alone;
        not batching, the oldest (its prompt is prefilled when its turn comes)."""
        if not self._sequences or (self.batch is not None and len(self._sequences) != 1):
            return None
        sequence = next(iter(self._sequences.values()))
        return None if self.batch is not None and sequence in self.batch else sequence

    # -- decoding -----------------------------------------------------------------

    def _advance_solo(self, sequence: Sequence) -> None:
        """Start, prefill (a chunk at a time, watching the inbox) and decode the lone sequence."""
        if sequence.solo is None:
            sequence.solo = self._start_solo(sequence)
        solo = sequence.solo
        while not solo.prefilled:
            self._fault("prefill", sequence.request)
            solo.prefill_chunk(self.settings.prefill_step_size)
            if not self.inbox.empty():
                return  # a cancel, a stop or a new request is seen within one chunk
        if solo.burst is not None:
            from .burst_loop import run_burst

            assert self.speculation is not None
            run_burst(solo, sequence.output, self.settings.block_size, self.policy.state == "profiling",
                      mail=lambda: not self.inbox.empty(), emit=lambda tokens: self.emit(sequence, tokens))
        else:
            self._run_classic(sequence, solo)

    def _start_solo(self, sequence: Sequence) -> SoloDecoder:
        from mlx_lm.models.cache import make_prompt_cache

        from .solo import SoloDecoder

        assert sequence.prompt_state is not None
        cache, cached_tokens, rest = sequence.prompt_state
        sequence.prompt_state = None
        if cache is None:
            cache = make_prompt_cache(self.model)
        burst = None
        request = sequence.request
        speculation = self.speculation
        if speculation is not None and speculation.split is not None and self._burst_allowed(request):
            from .burst import Burst
            from .sampling import SpeculativeSampler

            chain = sequence.chain
            burst = Burst(speculation.target, speculation.drafter.new_sequence(cache), speculation.split,
                          SpeculativeSampler(chain) if chain is not None else None,
                          before_verify=lambda: self._fault("verify", request), processors=sequence.processors)
            sequence.burst = burst.stats
        return SoloDecoder(self.model, self.stream, sequence.sampler, cache, list(cached_tokens), list(rest), burst,
                           before_step=lambda: self._fault("solo_step", request), processors=sequence.processors)

    def _run_classic(self, sequence: Sequence, solo: SoloDecoder) -> None:
        """Decode *sequence* alone until it finishes or a message arrives (then it parks)."""
        output = sequence.output
        solo.resume()
        while True:
            # Stop feeding once the token about to be emitted is the last allowed,
            # or when the worker has mail: then the sequence parks, ready to batch.
            feed_next = output.remaining > 1 and self.inbox.empty()
            token, logprobs = solo.emit(feed_next)
            self.emit(sequence, [token], logprobs)
            if output.finish_reason is not None or solo.parked:
                return
            if output.generated % CANCEL_CHECK_TOKENS == 0:
                self._publish_load()
                trio.from_thread.check_cancelled()

    def emit(self, sequence: Sequence, tokens: list[int], logprobs: Any = None) -> bool:
        """Deliver a solo sequence's new *tokens*; retire it if they finish it. True when finished."""
        events: list[tuple[str, Event]] = []
        output = sequence.output
        for token in tokens:
            delta = output.on_token(token, logprobs, output.natural_finish(token))
            self.observability.generated_tokens.inc()
            if delta is not None:
                events.append((sequence.request.id, delta))
            if output.finish_reason is not None:
                break
        finished = output.finish_reason is not None
        if finished:
            assert sequence.solo is not None
            self._retire_solo(sequence, sequence.solo, events)
        if events:
            self._deliver(events)
        return finished

    def _retire_solo(self, sequence: Sequence, solo: SoloDecoder, events: list[tuple[str, Event]]) -> None:
        """A solo sequence finished: keep its cache, report its burst, send its Finish."""
        if solo.round_in_flight:  # a stop string ended it with a round on the device: drop that round
            solo.finish_round(count=False)
        self._keep(solo.tokens_in_cache, solo.cache)
        self._forget(sequence)
        stats = sequence.burst
        # A sample needs classic decode timed beside it: never let the static gate pass for a measurement.
        if stats is not None and stats.rounds and stats.classic_steps and not sequence.ever_batched:
            self.policy.on_sample(stats.sample())
        assert sequence.output.finish_reason is not None
        events.append((sequence.request.id, self._finish(sequence, sequence.output.finish_reason)))
        self.observability.cache = self.prefix.stats()
        self._publish_load()

    def _batch_step(self, batch: ContinuousBatch[Sequence]) -> None:
        """One step of the batch. If the step itself raises, the caller fails the batch and rebuilds
        it; a failure in one sequence's own handling (its text, its logprobs) ends that one only."""
        for sequence in batch.sequences:
            self._fault("batch_step", sequence.request)
        responses = batch.step()
        events: list[tuple[str, Event]] = []
        finished: list[tuple[Sequence, Any]] = []
        failed: list[tuple[Sequence, Exception]] = []
        for sequence, response in responses:
            if (grammar := sequence.grammar_failure()) is not None:
                failed.append((sequence, grammar))  # its token came from unmasked logits: never delivered
                continue
            try:
                delta = sequence.output.on_token(response.token, response.logprobs, response.finish_reason)
            except Exception as exc:
                failed.append((sequence, exc))
                continue
            self.observability.generated_tokens.inc()
            if delta is not None:
                events.append((sequence.request.id, delta))
            if sequence.output.finish_reason is not None:
                finished.append((sequence, response))
        try:
            if finished:  # a take_out that raises leaves them in the batch, which then fails whole
                kept = batch.take_out(finished)
                for sequence, _ in finished:
                    cache, tokens = kept[id(sequence)]
                    self._keep(tokens, cache)
                    self._forget(sequence)
                    assert sequence.output.finish_reason is not None
                    events.append((sequence.request.id, self._finish(sequence, sequence.output.finish_reason)))
                self.observability.cache = self.prefix.stats()
        finally:  # what was built is delivered, whatever happens after
            self._publish_load()
            if events:
                self._deliver(events)
        for sequence, error in failed:
            self._fail([sequence], error)

    def _keep(self, tokens: list[int], cache: Any) -> None:
        """Offer a finished sequence's cache to the prefix cache; a failure loses only the reuse."""
        if cache is None or not tokens:
            return
        try:
            self.prefix.store(tokens, cache)
        except Exception:
            logger.exception("could not keep a finished prompt cache")

    def _forget(self, sequence: Sequence) -> None:
        """Drop *sequence* from the worker, and from the batch if it is still there."""
        if self._sequences.pop(sequence.request.id, None) is not None and sequence.burst is not None:
            # Every burst counts, however its request ended (finished, batched, cancelled, failed).
            self.observability.draft_tokens.inc(sequence.burst.proposed)
            self.observability.draft_accepted.inc(sequence.burst.accepted)
        if self.batch is not None:
            self.batch.discard(sequence)
        sequence.solo = None

    def _finish(self, sequence: Sequence, reason: FinishReason, error: str | None = None,
                error_type: ErrorType = "server_error") -> Finish:
        return sequence.output.finish(reason, sequence.admitted, sequence.cached, sequence.burst, error, error_type)

    def _publish_load(self) -> None:
        # Sequences are served in admission order: the first ``parallel`` hold the slots, the rest wait.
        self.observability.publish_load([(len(s.request.prompt_tokens), s.output.generated)
                                         for s in self._sequences.values()], self._parallel)
