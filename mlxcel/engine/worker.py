"""The engine's worker: one OS thread that makes every MLX call of the server.

MLX streams are bound to the thread that creates them, so the worker loads the
model, owns the caches, the continuous-batching generator and the MTP policy,
and runs the decode loop, all on this one thread for the life of the server.
It talks to the trio side through a thread-safe inbox (requests, cancellations,
stop) and hands events back with ``TrioToken.run_sync_soon``, which never
blocks: the decode loop never waits on the HTTP side.

What to do is the :class:`~.scheduler.Scheduler`'s decision (pure); the worker
applies it with MLX. Faults are isolated per request: an exception while
serving a sequence ends that request with an error and frees it; a failure of
the batch step fails the sequences in it and rebuilds the batch. Serving goes
on either way.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import trio

from ..hardware import kernel_versions
from ..models.images import PromptImage
from ..models.loader import CheckpointInfo
from ..observability import ModelLimits, Observability
from ..policy import BootFacts, HintStore, MtpPolicy
from .batch import ContinuousBatch
from .batch_mtp import BatchMtp
from .batch_turn import BatchTurns
from .instrument import Instrument
from .messages import Inbound, LoadCancelled, ReadDone, WorkerSettings
from .read_ahead import ReadAhead
from .requests import CLIENT_GONE, ErrorType, Event, Finish, FinishReason, GenerationRequest
from .scheduler import BatchTurn, Capabilities, Intake, Place, Scheduler, ScoreTurn, SoloTurn
from .sequence import Sequence, new_sequence
from .solo_turn import SoloTurns

if TYPE_CHECKING:  # the worker imports mlx on its own thread, not at import time
    from .speculation import Speculation

logger = logging.getLogger(__name__)

#: How long an idle worker waits for work before checking for cancellation.
IDLE_POLL_SECONDS = 0.05

Events = list[tuple[str, Event]]


class Worker:
    """Owns MLX for the server. :meth:`run` is the thread's whole life."""

    def __init__(self, settings: WorkerSettings, checkpoint: CheckpointInfo, observability: Observability,
                 inbox: queue.SimpleQueue[Inbound], deliver: Callable[[Events], None],
                 on_ready: Callable[[Any, Any], None], instrument: Instrument | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.observability = observability
        self.inbox = inbox
        self.deliver = deliver
        self.instrument = instrument
        self._on_ready = on_ready
        self._stopping = stopping
        hints = (HintStore(settings.cache_root, kernel_versions())
                 if settings.cache_root is not None else None)
        self.hints = hints
        self.policy = MtpPolicy(settings.policy, hints, publish=observability.publish_policy)
        self.batch_mtp: BatchMtp | None = None  # the rule of K and the batch's speculation (decided at load)
        self.scheduler = Scheduler(Capabilities())
        self.model: Any = None
        self.vision: Any = None
        """The checkpoint's vision half (``WorkerSettings.vision``), or None."""
        self.tokenizer: Any = None
        self.stream: Any = None
        self.eos_tokens: frozenset[int] = frozenset()
        self.speculation: Speculation | None = None
        self.batch: ContinuousBatch[Sequence] | None = None  # when batching
        self.prefix: Any = None
        self.new_cache: Callable[[], list[Any]] = list  # the model's fresh cache (decided at load)
        self.snapshots = False  # whether prefills keep snapshots (decided at load)
        self.batch_turns = BatchTurns(self)
        self.sequences: dict[str, Sequence] = {}
        self.read_ahead = ReadAhead(self._read_ahead, lambda: inbox.put(ReadDone()))
        self._release: Callable[[], None] = lambda: None  # what the loaded model needs when the worker ends

    # -- the thread -------------------------------------------------------------

    def run(self) -> None:
        from ..models.attention import mlx_thread
        from ..models.thread_state import released

        # From the load on (its probe included), this thread's attention is mlxcel's; trio's cached thread
        # outlives this run, so what MLX keeps per thread is released at its end.
        with released(), mlx_thread():
            self._serve()

    def _serve(self) -> None:
        from .load_progress import reported

        try:
            with reported(self.observability):
                self._load()
        except LoadCancelled:
            raise  # a stop, not a failure: the state stays "stopping"
        except BaseException:
            self.observability.state = "failed"
            raise
        try:
            self._loop()
        finally:
            self._persist()
            self.policy.on_worker_lost()
            if self.batch is not None:
                self.batch.close()
            self._release()

    def _persist(self) -> None:
        """What the prefix cache holds, to its disk tier, and the batch's step costs beside the policy's hint;
        a failure loses only the reuse after a restart."""
        try:
            self.prefix.persist()
        except Exception:
            logger.exception("could not write the prompt cache to disk")
        finally:
            self.prefix.close()
        if self.batch_mtp is not None:
            self.batch_mtp.save()

    def _check_stopping(self) -> None:
        if self._stopping():
            raise LoadCancelled("stopped while loading the model")

    def _load(self) -> None:
        from .loading import cache_cost, load
        from .prefix_cache import rewindable
        from .prompt_disk import open_prefix_cache

        if self.instrument is not None:
            self.instrument.before_load()
        loaded = load(self.settings, self.checkpoint, self._check_stopping, self.hints)
        self.model, self.tokenizer, self.stream = loaded.model, loaded.tokenizer, loaded.stream
        self.eos_tokens, self.speculation, self._release = loaded.eos_tokens, loaded.speculation, loaded.release
        self.new_cache = loaded.new_cache
        if self.settings.vision:
            from ..checkpoints import load_vision

            self.vision = load_vision(self.checkpoint, self.model)
        capabilities = loaded.capabilities
        self.scheduler = Scheduler(capabilities)
        layers = self.new_cache()
        self.batch_mtp = BatchMtp(self.model, self.speculation, layers, self.settings.policy.pin,
                                  self.settings.block_size, capabilities.parallel, self.policy, self.hints,
                                  loaded.pairing, loaded.embedding_rows, batching=capabilities.batching,
                                  memo=loaded.probe_memo)
        if capabilities.batching:
            self.batch = ContinuousBatch(self.model, self.eos_tokens, capabilities.parallel,
                                         self.settings.prefill_step_size, self.stream, self.batch_mtp.speculation,
                                         self.batch_mtp.rule)
        self.prefix = open_prefix_cache(self.settings, self.checkpoint, layers)
        self.observability.cache = self.prefix.stats()  # the disk tier read back: shown before any request
        self.publish_load()
        speculation = self.speculation
        self.policy.on_worker_ready(BootFacts(host=loaded.host, pairing=loaded.pairing,
                                              probe_decline=speculation.decline if speculation else None,
                                              sharded=loaded.sharded))
        if self.batch_mtp is not None:
            self.batch_mtp.publish()
        if speculation is not None and speculation.decline is not None and self.policy.state != "exactness_declined":
            # The policy logs a veto itself only when it declines: a pin or adaptive-off hides it.
            logger.warning("MTP exactness probe vetoed the burst (MTP is %s, so no burst will run): %s",
                           self.policy.state, speculation.decline)
        # Only a cache that cannot be rewound needs snapshots: a KV cache is trimmed back instead.
        self.snapshots = not rewindable(layers) and not self.prefix.off
        sequence_bytes, token_bytes = (cache_cost(loaded.model, loaded.new_cache) if self.settings.measure_kv
                                       else (0, 0.0))
        self.observability.limits = ModelLimits(vocab_size=loaded.vocab, embedding_size=loaded.embedding_rows,
                                                context_length=self.checkpoint.context_length,
                                                snapshots=self.snapshots, sequence_bytes=sequence_bytes,
                                                token_bytes=token_bytes)
        self._on_ready(self.tokenizer, loaded.grammar_tokenizer)

    def _loop(self) -> None:
        solo = SoloTurns(self)
        while True:
            if not self._take_messages(block=not self.sequences):
                return
            trio.from_thread.check_cancelled()
            turn = self.scheduler.turn()
            if isinstance(turn, SoloTurn):
                sequence = self.sequences[turn.request_id]
                try:
                    solo.advance(sequence)
                except Exception as exc:
                    self.fail([sequence], exc)
            elif isinstance(turn, BatchTurn):
                self.batch_turns.advance(turn)
            elif isinstance(turn, ScoreTurn):
                self._score_turn(self.sequences[turn.request_id])

    # -- what comes in -------------------------------------------------------------

    def _take_messages(self, block: bool) -> bool:
        """Apply every message waiting (waiting a little for one if *block*); False on Stop."""
        try:
            messages = [self.inbox.get(timeout=IDLE_POLL_SECONDS) if block else self.inbox.get_nowait()]
        except queue.Empty:
            return True
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        passed, ended = self.read_ahead.sort(messages)
        intake = self.scheduler.take(passed)
        events: Events = [*ended, *intake.finished]
        if intake.stop is not None:
            for sequence in list(self.sequences.values()):
                self.forget(sequence)
                events.append((sequence.request.id, self.finish(sequence, "error", intake.stop)))
            self.deliver(events)
            return False
        self._apply(intake, events)
        self.publish_load()
        if events:
            self.deliver(events)
        return True

    def _read_ahead(self, request: GenerationRequest) -> Future[Any] | None:
        """The read of the disk tier's entry for *request*'s prompt, started (:mod:`.read_ahead`); None for a
        prompt with images (its entries are keyed by them) or scored whole (it resumes from nothing)."""
        if request.images or request.prompt_logprobs:
            return None
        try:
            return self.prefix.read_ahead(list(request.prompt_tokens))
        except Exception as exc:  # the arrival is admitted as without a read ahead, which says what is wrong
            logger.warning("request %s: no read ahead of its prompt cache entry: %s: %s", request.id,
                           type(exc).__name__, exc)
            return None

    def _apply(self, intake: Intake, events: Events) -> None:
        for request_id in intake.cancelled:
            sequence = self.sequences[request_id]
            self.forget(sequence)
            events.append((request_id, self.finish(sequence, "cancelled", CLIENT_GONE)))
        self.batch_turns.insert_each(intake.to_batch)
        for request, place in intake.admitted:
            self._admit(request, place, events)
        self.observability.cache = self.prefix.stats()

    def _admit(self, request: GenerationRequest, place: Place, events: Events) -> None:
        """Start serving *request*: its record, its prompt's prefix from the cache, its prompt's scorer."""
        tokens = list(request.prompt_tokens)
        try:
            # A prompt to score goes through the model whole: that forward is its prefill too.
            reused: int | None = None  # prompt tokens the prefix cache gave, where not all those already in a cache
            if request.images:  # its images' features in place; the prefix cache keyed by the images too
                cache, rest, drafter, reused = self._image_prompt(tokens, request.images)
            else:
                cache, rest, drafter = self.prefix.fetch(tokens) if place != "scoring" \
                    else (self.new_cache(), tokens, None)
            cached = len(tokens) - len(rest)
            probe = self.instrument.probe(request) if self.instrument is not None else None
            sequence = new_sequence(request, self.tokenizer, self.eos_tokens, cached if reused is None else reused,
                                    probe)
            sequence.prompt_state = (cache, tokens[:cached], rest)  # prefilled on its turn
            sequence.drafter_state = drafter
            if place == "scoring":  # its scores are the request's first event: a chunk per scoring turn
                from .prompt_scoring import PromptScorer

                sequence.scorer = PromptScorer(self.model, self.stream, tokens, request.top_logprobs, cache)
        except Exception as exc:  # a request the model cannot take must not stop the worker
            logger.error("request %s could not be admitted: %s: %s", request.id, type(exc).__name__, exc)
            self.scheduler.ended(request.id)
            events.append((request.id, Finish("error", len(tokens), 0, error=f"cannot start generation: {exc}")))
            return
        self.sequences[request.id] = sequence
        self.observability.prompt_tokens.inc(len(tokens))

    def _image_prompt(self, tokens: list[int], images: tuple[PromptImage, ...]
                      ) -> tuple[Any, list[int], Any, int]:
        """(cache, tokens still to prefill, drafter state, tokens the prefix cache gave) of a prompt with
        *images*: from the prefix cache when an entry holds all of its images (keyed by them:
        :meth:`~mlxcel.models.images.VisionPrefill.keys`), else a cache holding all of it but the last token,
        prefilled here (from the prefix cache's entry for its text before the images, where it holds one; the
        other sequences wait for it, as for a prefill chunk), and offered to the prefix cache as a snapshot."""
        import mlx.core as mx

        if self.vision is None:
            raise ValueError("this model takes no images")
        keys = self.vision.keys(tokens, images)
        found = self.prefix.fetch(keys)
        cached = len(tokens) - len(found.rest)
        last_image = max(i for i, key in enumerate(keys) if key < 0) if any(key < 0 for key in keys) else -1
        if found.cache is not None and cached > last_image:
            return found.cache, tokens[cached:], found.drafter, cached
        first = tokens.index(self.vision.image_token_id) if self.vision.image_token_id in tokens else 0
        resumed = found.cache is not None and 0 < cached <= first
        cache, start = (found.cache, cached) if resumed else (self.new_cache(), 0)
        step = self.settings.prefill_step_size
        with mx.stream(self.stream):
            if start < first:
                # A snapshot where the images begin: an agent's next prompt, another screenshot after the same
                # long system prompt and tools, resumes there (a hybrid model's cache cannot be rewound to it).
                self.vision.prefill(self.model, tokens[:-1], images, cache, start, step, stop=first)
                self.snapshot(keys[:first], cache, None)
                start = first
            self.vision.prefill(self.model, tokens[:-1], images, cache, start, step)
        self.snapshot(keys[:-1], cache, None)
        return cache, tokens[-1:], None, cached if resumed else 0

    def cache_keys(self, sequence: Sequence, tokens: list[int]) -> list[int]:
        """What the prefix cache keeps a sequence's cache holding *tokens* (its prompt, then its output) under."""
        images = sequence.request.images
        if not images or self.vision is None:
            return tokens
        prompt = list(sequence.request.prompt_tokens)
        return self.vision.keys(prompt, images) + tokens[len(prompt):]

    def _score_turn(self, sequence: Sequence) -> None:
        """Score the next chunk of *sequence*'s prompt; once it is whole, deliver its scores (the request's
        first event) and let it decode from the scorer's cache (its prompt but the last token, fed)."""
        assert sequence.scorer is not None
        try:
            if self.instrument is not None:
                self.instrument.at("score", sequence.request)
            scores = sequence.scorer.step()
        except Exception as exc:
            self.fail([sequence], exc)
            return
        if scores is not None:
            assert sequence.prompt_state is not None
            cache, tokens = sequence.prompt_state[0], list(sequence.request.prompt_tokens)
            sequence.scorer, sequence.prompt_state = None, (cache, tokens[:-1], tokens[-1:])  # all but the last fed
            self.scheduler.scored(sequence.request.id)
            self.deliver([(sequence.request.id, scores)])

    # -- what goes out -----------------------------------------------------------------

    def fail(self, sequences: list[Sequence], exc: Exception) -> None:
        """End *sequences* with an error (their caches are dropped, not reused); serving goes on."""
        from .grammar import GrammarError  # here: grammar.py imports mlx, which a router never loads

        events: Events = []
        grammar = isinstance(exc, GrammarError)  # the request's own grammar: a 400, not the server's fault
        report = logger.warning if grammar else logger.error  # a client's grammar failing is not a server fault
        for sequence in sequences:
            report("request %s failed: %s: %s", sequence.request.id, type(exc).__name__, exc)
            self.forget(sequence)
            message = f"the response's grammar cannot be followed: {exc}" if grammar \
                else f"generation failed: {type(exc).__name__}: {exc}"
            events.append((sequence.request.id, self.finish(sequence, "error", message,
                                                            "invalid_request_error" if grammar else "server_error")))
        self.publish_load()
        self.deliver(events)

    def snapshot(self, tokens: list[int], cache: Any, drafter: tuple[int, Any] | None) -> None:
        """Offer a live sequence's cache at a prompt position (and its drafter, see ``PrefixCache.snapshot``) to
        the prefix cache; a failure loses only the reuse."""
        try:
            self.prefix.snapshot(list(tokens), cache, drafter)
        except Exception:
            logger.exception("could not keep a snapshot of a prompt cache")

    def keep(self, tokens: list[int], cache: Any) -> None:
        """Offer a finished sequence's cache to the prefix cache; a failure loses only the reuse."""
        if cache is None or not tokens:
            return
        try:
            self.prefix.store(tokens, cache)
        except Exception:
            logger.exception("could not keep a finished prompt cache")

    def forget(self, sequence: Sequence) -> None:
        """Drop *sequence* from the worker, the scheduler, and the batch if it is still there."""
        self.scheduler.ended(sequence.request.id)
        if self.sequences.pop(sequence.request.id, None) is not None and sequence.burst is not None:
            # Every burst counts, however its request ended (finished, batched, cancelled, failed).
            self.observability.draft_tokens.inc(sequence.burst.proposed)
            self.observability.draft_accepted.inc(sequence.burst.accepted)
        if self.batch is not None:
            self.batch.discard(sequence)
        sequence.solo = None

    def finish(self, sequence: Sequence, reason: FinishReason, error: str | None = None,
               error_type: ErrorType = "server_error") -> Finish:
        return sequence.output.finish(reason, sequence.admitted, sequence.cached, sequence.burst, error, error_type)

    def publish_load(self) -> None:
        # Those decoding first (solo, or in the batch), then those waiting for a place or their prompt's scores.
        ordered = sorted(self.sequences.values(),
                         key=lambda s: self.scheduler.place(s.request.id) in ("waiting", "scoring"))
        self.observability.publish_load([(len(s.request.prompt_tokens), s.output.generated) for s in ordered],
                                        self.scheduler.capabilities.parallel, reading=len(self.read_ahead))
