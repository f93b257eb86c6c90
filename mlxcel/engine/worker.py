"""The engine's worker: one OS thread that makes every MLX call of the server.

MLX streams are bound to the thread that creates them, so the worker loads the
model, owns the caches, the continuous-batching generator and the MTP policy,
and runs the decode loop, all on this one thread for the life of the server.
It talks to the trio side through a thread-safe inbox (requests, cancellations,
stop) and hands events back with ``TrioToken.run_sync_soon``, which never
blocks: the decode loop never waits on the HTTP side.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..hardware import detect_host
from ..models.drafters import DrafterSpec
from ..models.loader import CheckpointInfo, load_checkpoint
from ..observability import CacheStats, ModelLimits, Observability, SlotState
from ..policy import BootFacts, BurstSample, HintStore, MtpPolicy, PairingKey, PolicySettings
from .requests import BurstStats, Event, Finish, FinishReason, GenerationRequest, TextDelta, Timings
from .text import StopStringFilter

if TYPE_CHECKING:  # the worker imports mlx on its own thread, not at import time
    from .mtp import Selection
    from .solo import SoloDecoder

logger = logging.getLogger(__name__)

#: How long an idle worker waits for work before checking for cancellation.
IDLE_POLL_SECONDS = 0.05

#: While profiling, after every PROBE_EVERY rounds the burst runs CLASSIC_PROBE_STEPS
#: drafterless single-token steps (real greedy tokens), timing classic decode here and now.
PROBE_EVERY = 4
CLASSIC_PROBE_STEPS = 2


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    parallel: int = 4
    """Sequences that decode together (1 with ``--no-batch``)."""
    batch: bool = True
    """False: the legacy single-sequence worker, which has no MTP path."""
    prefix_cache_entries: int = 8
    prefill_step_size: int = 512
    policy: PolicySettings = field(default_factory=PolicySettings)
    cache_root: Path | None = None
    """Where persisted policy hints live, or None to keep verdicts in memory."""
    drafter: DrafterSpec | None = None
    """The MTP drafter (``--mtp`` / ``--draft-model``), or None: no MTP dispatch."""
    block_size: int = 4
    """K, the verify width of a speculative round (K-1 drafts)."""


@dataclass(frozen=True, slots=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str = "server shutting down"


Message = Submit | Cancel | Stop


@dataclass
class _Sequence:
    """A request the worker is serving, alone (``solo``) or in the continuous batch (``uid``)."""

    request: GenerationRequest
    detokenizer: Any
    stop: StopStringFilter
    sampler: Callable[[Any], Any] | None
    admitted: float
    cached: int
    uid: int | None = None
    solo: SoloDecoder | None = None
    prompt_state: tuple[Any, list[int], list[int]] | None = None
    """(prefix cache, its tokens, tokens still to prefill) of a sequence waiting for its solo turn."""
    first_token_at: float | None = None
    burst: BurstStats | None = None
    """Set when this request runs the B=1 MTP burst."""
    speculative: Any = None
    """The burst's acceptance rule at temperature > 0 (a SpeculativeSampler); None is greedy."""
    batched: bool = False
    """Ever decoded in the batch (B>1): then its burst is not a policy sample."""
    generated: int = 0
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - self.generated


class _PrefixCache:
    """mlx-lm's LRU prompt cache, with the statistics ``/v1/cache/stats`` shows."""

    def __init__(self, key: str, entries: int) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self._key = key
        self._lru = LRUPromptCache(max_size=entries)
        self._entries = entries
        self._lookups = self._hits = self._prompt_tokens = self._reused = 0

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A cache covering a prefix of *tokens*, and the tokens still to prefill (never empty)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        cache, rest = self._lru.fetch_nearest_cache(self._key, tokens)
        if cache is not None and not rest:
            # An exact hit still needs the last token's logits: step back one.
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        self._lookups += 1
        self._prompt_tokens += len(tokens)
        if cache is not None:
            self._hits += 1
            self._reused += len(tokens) - len(rest)
        return cache, list(rest)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        self._lru.insert_cache(self._key, list(tokens), cache)

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self._lru), bytes=self._lru.nbytes, max_entries=self._entries,
                          lookups=self._lookups, hits=self._hits, prompt_tokens=self._prompt_tokens,
                          reused_tokens=self._reused)


def _batchable(model: Any) -> bool:
    """Whether every cache of *model* can be merged into a batch (mlx-lm's own test)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(cache, "merge") for cache in make_prompt_cache(model))


def _make_sampler(request: GenerationRequest) -> Callable[[Any], Any] | None:
    """None for greedy (the batch then samples in one call); else a per-request sampler."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_sampler

    params = request.sampling
    if params.temperature == 0:
        return None
    if params.seed is None:
        sampler: Callable[[Any], Any] = make_sampler(temp=params.temperature, top_p=params.top_p,
                                                     top_k=params.top_k)
        return sampler
    key = mx.random.key(params.seed)

    def seeded(logprobs: Any) -> Any:
        nonlocal key
        key, step_key = mx.random.split(key)
        if 0 < params.top_p < 1:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        return mx.random.categorical(logprobs * (1 / params.temperature), key=step_key)

    return seeded


class Worker:
    """Owns MLX for the server. :meth:`run` is the thread's whole life."""

    generator: Any  # mlx-lm's BatchGenerator: continuous batching of classic decode

    def __init__(self, settings: WorkerSettings, checkpoint: CheckpointInfo, observability: Observability,
                 inbox: queue.SimpleQueue[Message], deliver: Callable[[list[tuple[str, Event]]], None],
                 on_ready: Callable[[Any], None], before_load: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.observability = observability
        self.inbox = inbox
        self._deliver = deliver
        self._on_ready = on_ready
        self._before_load = before_load
        hints = HintStore(settings.cache_root) if settings.cache_root is not None else None
        self.policy = MtpPolicy(settings.policy, hints, publish=observability.publish_policy)
        self.drafter_head: Any = None  # the MTP head, once loaded
        self.selection: Selection | None = None  # the exact verify kernel selection, if any
        self._sequences: dict[str, _Sequence] = {}
        self._by_uid: dict[int, _Sequence] = {}

    # -- the thread -------------------------------------------------------------

    def run(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        from .mtp import TargetModel

        try:
            if self._before_load is not None:
                self._before_load()
            self.model, tokenizer = load_checkpoint(self.checkpoint)
            host = detect_host()
            self.stream = mx.new_stream(mx.default_device())
            self.target = TargetModel(self.model)
            pairing, probe_decline = self._load_drafter(host.label, len(tokenizer))
        except BaseException:
            self.observability.state = "failed"
            raise
        self.tokenizer = tokenizer
        self.eos_tokens = frozenset(tokenizer.eos_token_ids)
        with mx.stream(self.stream):  # one token through the model: the width of its logits
            vocab = int(self.model(mx.array([[0]])).shape[-1])
        self.observability.limits = ModelLimits(vocab_size=vocab, embedding_size=vocab,
                                                context_length=self.checkpoint.context_length)
        # Batching needs caches that merge; without it (or with --no-batch) sequences
        # decode solo, one at a time, first come first served.
        self._batching = self.settings.batch and self.settings.parallel > 1 and _batchable(self.model)
        if self.settings.batch and not self._batching and self.settings.parallel > 1:
            logger.warning("%s keeps caches that cannot be merged into a batch: serving one sequence "
                           "at a time", self.checkpoint.name)
        self._parallel = self.settings.parallel if self._batching else 1
        self.generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in sorted(self.eos_tokens)],
            completion_batch_size=self._parallel,
            prefill_batch_size=self._parallel,
            prefill_step_size=self.settings.prefill_step_size,
            stream=self.stream,
        ) if self._batching else None
        self.prefix = _PrefixCache(str(self.checkpoint.path), self.settings.prefix_cache_entries)
        self._publish_load()
        self.policy.on_worker_ready(BootFacts(host=host, pairing=pairing, probe_decline=probe_decline))
        self.observability.state = "ready"
        self._on_ready(tokenizer)
        try:
            self._loop()
        finally:
            self.policy.on_worker_lost()
            if self.generator is not None:
                self.generator.close()

    def _load_drafter(self, hardware: str, vocab: int) -> tuple[PairingKey | None, str | None]:
        """Load the drafter and probe exactness: (the policy's pairing key, the probe's veto)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from ..models.drafters.loader import load_drafter
        from .mtp import DESCRIBE, probe_exactness

        spec = self.settings.drafter
        if spec is None or not self.settings.batch:
            return None, None  # no MTP dispatch (the legacy worker has no MTP path)
        self.drafter_head = load_drafter(spec, self.checkpoint.path)
        k = self.settings.block_size
        with mx.stream(self.stream):
            probe = probe_exactness(self.target, lambda: make_prompt_cache(self.model), k, vocab)
        if probe.selection is not None:
            logger.info("MTP exactness probe: the K=%d verify is byte-identical to the single-token chain "
                        "with %s", k, DESCRIBE[probe.selection])
        self.selection = probe.selection
        if probe.selection is None and self.settings.policy.allow_inexact:
            self.selection = "wide"  # MLXCEL_MTP_ALLOW_INEXACT: run anyway, exactness forfeited
        return PairingKey(self.checkpoint.name, spec.name, hardware, k), probe.detail

    def _burst_allowed(self, request: GenerationRequest) -> bool:
        """The runtime gates of the B=1 burst, below the policy's live gate."""
        return (self.drafter_head is not None and self.selection is not None
                and bool(self.policy.mtp_enabled)
                and not request.logprobs)  # logprobs come from classic decode

    def _loop(self) -> None:
        while True:
            if not self._take_messages(block=not self._sequences):
                return
            trio.from_thread.check_cancelled()
            solo = self._solo_sequence()
            if solo is not None:
                self._run_solo(solo)
            elif self._sequences:
                self._batch_step()

    def _solo_sequence(self) -> _Sequence | None:
        """The sequence to decode alone now, if any.

        Batching: the only sequence, if it started alone. Not batching: the oldest
        sequence, whose prompt is prefilled when its turn comes.
        """
        if not self._sequences or (self._batching and len(self._sequences) != 1):
            return None
        sequence = next(iter(self._sequences.values()))
        if sequence.uid is not None:
            return None  # in the batch
        if sequence.solo is None and sequence.prompt_state is not None:
            from mlx_lm.models.cache import make_prompt_cache

            from .mtp import Drafter
            from .solo import SoloDecoder

            cache, cached_tokens, rest = sequence.prompt_state
            sequence.prompt_state = None
            drafter = None
            if self._burst_allowed(sequence.request):
                drafter = Drafter(self.drafter_head, self.target)
                sequence.burst = BurstStats()
                params = sequence.request.sampling
                if params.temperature > 0:
                    from .mtp import SpeculativeSampler

                    sequence.speculative = SpeculativeSampler(params.temperature, params.top_p, params.top_k,
                                                              params.seed)
            sequence.solo = SoloDecoder.prefill(
                self.target, self.stream, sequence.sampler,
                cache if cache is not None else make_prompt_cache(self.model), cached_tokens, rest,
                self.settings.prefill_step_size, drafter)
        return sequence

    def _take_messages(self, block: bool) -> bool:
        """Handle every message waiting (waiting a little if *block*); False on Stop."""
        events: list[tuple[str, Event]] = []
        submitted: list[GenerationRequest] = []
        try:
            message = self.inbox.get(timeout=IDLE_POLL_SECONDS) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        try:
            while True:
                if isinstance(message, Stop):
                    self._end_all("error", message.reason, events)
                    self._deliver(events)
                    return False
                if isinstance(message, Submit):
                    submitted.append(message.request)
                elif isinstance(message, Cancel):
                    self._cancel(message.request_id, events)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if submitted:
            self._admit(submitted, events)
        self._publish_load()
        if events:
            self._deliver(events)
        return True

    # -- requests ---------------------------------------------------------------

    def _admit(self, requests: list[GenerationRequest], events: list[tuple[str, Event]]) -> None:
        """A lone request decodes solo; anything more joins (or moves into) the continuous batch."""
        alone = not self._sequences and len(requests) == 1
        batch = self._batching and not alone
        if batch:
            for sequence in list(self._sequences.values()):
                if sequence.uid is None:
                    self._into_batch(sequence)
        for request in requests:
            tokens = list(request.prompt_tokens)
            try:
                cache, rest = self.prefix.fetch(tokens)
                sequence = _Sequence(request=request, detokenizer=self.tokenizer.detokenizer,
                                     stop=StopStringFilter(request.stop), sampler=_make_sampler(request),
                                     admitted=time.perf_counter(), cached=len(tokens) - len(rest))
                cached_tokens = tokens[:len(tokens) - len(rest)]
                if batch:
                    sequence.batched = True
                    (sequence.uid,) = self.generator.insert(
                        [rest], max_tokens=[request.max_tokens], caches=[cache] if cache is not None else None,
                        all_tokens=[cached_tokens], samplers=[sequence.sampler])
                else:
                    sequence.prompt_state = (cache, cached_tokens, rest)  # prefilled on its solo turn
            except Exception as exc:  # a request the model cannot take must not stop the worker
                logger.exception("request %s could not be admitted", request.id)
                events.append((request.id, Finish("error", len(tokens), 0,
                                                  error=f"cannot start generation: {exc}")))
                continue
            self._sequences[request.id] = sequence
            if sequence.uid is not None:
                self._by_uid[sequence.uid] = sequence
            self.observability.prompt_tokens.inc(len(tokens))
        self.observability.cache = self.prefix.stats()

    def _into_batch(self, sequence: _Sequence) -> None:
        """Hand a parked solo sequence to the continuous batch, which continues from its state."""
        solo = sequence.solo
        if solo is None:  # not prefilled yet: the batch prefills it
            assert sequence.prompt_state is not None
            cache, cached_tokens, rest = sequence.prompt_state
            (sequence.uid,) = self.generator.insert(
                [rest], max_tokens=[sequence.remaining], caches=[cache] if cache is not None else None,
                all_tokens=[cached_tokens], samplers=[sequence.sampler])
            sequence.prompt_state = None
            sequence.batched = True
            self._by_uid[sequence.uid] = sequence
            return
        assert solo.parked
        (sequence.uid,) = self.generator.insert(
            [[solo.next_input]], max_tokens=[sequence.remaining], caches=[solo.cache],
            all_tokens=[solo.tokens_in_cache], samplers=[sequence.sampler])
        self._by_uid[sequence.uid] = sequence
        sequence.solo = None
        sequence.batched = True
        self.observability.handoffs.inc()

    def _cancel(self, request_id: str, events: list[tuple[str, Event]]) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is None:
            return
        if sequence.uid is not None:
            self.generator.remove([sequence.uid])
        self._forget(sequence)
        events.append((request_id, self._finish(sequence, "cancelled", "the client went away")))

    def _end_all(self, reason: FinishReason, error: str, events: list[tuple[str, Event]]) -> None:
        for sequence in list(self._sequences.values()):
            if sequence.uid is not None:
                self.generator.remove([sequence.uid])
            self._forget(sequence)
            events.append((sequence.request.id, self._finish(sequence, reason, error)))

    # -- decoding -----------------------------------------------------------------

    def _run_solo(self, sequence: _Sequence) -> None:
        """Decode *sequence* alone until it finishes or a message arrives (then it parks)."""
        solo = sequence.solo
        assert solo is not None
        if sequence.burst is not None:
            self._run_burst(sequence, solo, sequence.burst)
            return
        solo.resume()
        while True:
            # Stop feeding once the token about to be emitted is the last allowed,
            # or when the worker has mail: then the sequence parks, ready to batch.
            feed_next = sequence.remaining > 1 and self.inbox.empty()
            token, logprobs = solo.emit(feed_next)
            events: list[tuple[str, Event]] = []
            self._on_token(sequence, token, logprobs, self._solo_finish(sequence, token), events)
            if sequence.finish_reason is not None:
                self._retire_solo(sequence, solo, events)
            elif sequence.generated % 16 == 0:
                self._publish_load()
            if events:
                self._deliver(events)
            if sequence.finish_reason is not None or solo.parked:
                return

    def _run_burst(self, sequence: _Sequence, solo: SoloDecoder, burst: BurstStats) -> None:
        """Speculative rounds for a lone request, until it finishes or mail arrives (then it parks).

        Pipelined like classic decode: the next round is dispatched before this
        round's tokens are handled (detokenised, checked, delivered), so that
        work overlaps the device's. A round in flight when the sequence finishes
        (a stop string) is read back and dropped; the cache stays consistent.
        """
        assert self.selection is not None
        profiling = self.policy.state == "profiling"
        block_size, selection, sampler = self.settings.block_size, self.selection, sequence.speculative

        def probe_due() -> bool:
            return profiling and burst.rounds > 0 and burst.rounds % PROBE_EVERY == 0 \
                and burst.classic_steps < CLASSIC_PROBE_STEPS * (burst.rounds // PROBE_EVERY)

        def classic_next(remaining: int) -> bool:
            """Whether the next step must be classic: the last token, a due probe, nothing to draft from."""
            return remaining <= 1 or probe_due() or not solo.can_draft

        while True:
            if not solo.round_in_flight:
                if not self.inbox.empty():
                    return
                if classic_next(sequence.remaining):
                    probe = probe_due()
                    token, _, seconds = solo.classic_step()
                    if probe:
                        burst.classic_steps += 1
                        burst.classic_seconds += seconds
                    tokens = [token]
                else:
                    solo.start_round(min(block_size, sequence.remaining), selection)
            if solo.round_in_flight:
                tokens = solo.finish_round(burst, sampler)
                left = sequence.remaining - len(tokens)
                if self.inbox.empty() and not classic_next(left) and not self.eos_tokens.intersection(tokens):
                    solo.start_round(min(block_size, left), selection)
            events: list[tuple[str, Event]] = []
            for token in tokens:
                self._on_token(sequence, token, None, self._solo_finish(sequence, token), events)
                if sequence.finish_reason is not None:
                    break
            if sequence.finish_reason is not None:
                if solo.round_in_flight:
                    solo.finish_round(None, sampler)
                self._retire_solo(sequence, solo, events)
            if events:
                self._deliver(events)
            if sequence.finish_reason is not None:
                return

    def _solo_finish(self, sequence: _Sequence, token: int) -> FinishReason | None:
        """Why a solo sequence ends with *token*, if it does: end of sequence, or max_tokens."""
        if token in self.eos_tokens:
            return "stop"
        return "length" if sequence.remaining == 1 else None

    def _retire_solo(self, sequence: _Sequence, solo: SoloDecoder, events: list[tuple[str, Event]]) -> None:
        """A solo sequence finished: keep its cache, report its burst, send its Finish."""
        self.prefix.store(solo.tokens_in_cache, solo.cache)
        self._forget(sequence)
        burst = sequence.burst
        if burst is not None and burst.rounds and not sequence.batched:
            self.policy.on_sample(BurstSample(
                rounds=burst.rounds, proposed=burst.proposed, accepted=burst.accepted,
                round_seconds=burst.round_seconds, classic_steps=burst.classic_steps,
                classic_seconds=burst.classic_seconds))
        if burst is not None:
            self.observability.draft_tokens.inc(burst.proposed)
            self.observability.draft_accepted.inc(burst.accepted)
        assert sequence.finish_reason is not None
        events.append((sequence.request.id, self._finish(sequence, sequence.finish_reason)))
        self.observability.cache = self.prefix.stats()
        self._publish_load()

    def _batch_step(self) -> None:
        _, responses = self.generator.next()
        events: list[tuple[str, Event]] = []
        finished: list[tuple[_Sequence, Any]] = []
        for response in responses:
            sequence = self._by_uid.get(response.uid)
            if sequence is None:
                continue
            self._on_token(sequence, response.token, response.logprobs, response.finish_reason, events)
            if sequence.finish_reason is not None:
                finished.append((sequence, response))
        if finished:
            # Sequences stopped by a stop string are still in the batch: take them out with their caches.
            still_batched = [s.uid for s, r in finished if r.finish_reason is None]
            caches = self.generator.remove(still_batched, return_prompt_caches=True) if still_batched else {}
            for sequence, response in finished:
                cache, tokens = caches.get(sequence.uid, (response.prompt_cache, response.all_tokens))
                if cache is not None and tokens:
                    self.prefix.store(tokens, cache)
                self._forget(sequence)
                assert sequence.finish_reason is not None
                events.append((sequence.request.id, self._finish(sequence, sequence.finish_reason)))
            self.observability.cache = self.prefix.stats()
        self._publish_load()
        if events:
            self._deliver(events)

    def _on_token(self, sequence: _Sequence, token: int, logprobs: Any, reason: FinishReason | None,
                  events: list[tuple[str, Event]]) -> None:
        """Account for one generated token: text, stop strings, logprobs, and the finish reason."""
        if sequence.first_token_at is None:
            sequence.first_token_at = time.perf_counter()
        text = ""
        # A "stop" finish here is an end-of-sequence token: it ends the text, it is not part of it.
        if reason != "stop":
            sequence.generated += 1
            sequence.detokenizer.add_token(token)
            text = sequence.stop.feed(sequence.detokenizer.last_segment)
            sequence.pending_tokens.append(token)
            if sequence.request.logprobs and logprobs is not None:
                sequence.pending_logprobs.append(logprobs.reshape(-1)[token].item())
        if sequence.stop.stopped:
            reason = "stop"
        if reason is not None:
            sequence.detokenizer.finalize()
            if not sequence.stop.stopped:
                text += sequence.stop.feed(sequence.detokenizer.last_segment) + sequence.stop.flush()
            sequence.finish_reason = reason
        if text or (reason is not None and sequence.pending_tokens):
            events.append((sequence.request.id, TextDelta(
                text, tuple(sequence.pending_tokens),
                tuple(sequence.pending_logprobs) if sequence.request.logprobs else None)))
            sequence.pending_tokens.clear()
            sequence.pending_logprobs.clear()
        self.observability.generated_tokens.inc()

    def _forget(self, sequence: _Sequence) -> None:
        self._sequences.pop(sequence.request.id, None)
        if sequence.uid is not None:
            self._by_uid.pop(sequence.uid, None)

    def _finish(self, sequence: _Sequence, reason: FinishReason, error: str | None = None) -> Finish:
        now = time.perf_counter()
        first = sequence.first_token_at or now
        return Finish(
            reason=reason,
            prompt_tokens=len(sequence.request.prompt_tokens),
            completion_tokens=sequence.generated,
            timings=Timings(
                prompt_n=len(sequence.request.prompt_tokens) - sequence.cached,
                prompt_ms=(first - sequence.admitted) * 1000,
                predicted_n=sequence.generated,
                predicted_ms=(now - first) * 1000,
                cached_n=sequence.cached,
                draft_n=sequence.burst.proposed if sequence.burst else 0,
                draft_n_accepted=sequence.burst.accepted if sequence.burst else 0,
                draft_rounds=sequence.burst.rounds if sequence.burst else 0,
            ),
            error=error,
        )

    def _publish_load(self) -> None:
        """Slots, batch size and queue depth. Sequences are served in admission order, so
        the first ``parallel`` of them hold the slots and the rest wait."""
        serving = list(self._sequences.values())[:self._parallel]
        self.observability.slots = tuple(
            SlotState(id=i, is_processing=i < len(serving),
                      n_prompt_tokens=len(serving[i].request.prompt_tokens) if i < len(serving) else 0,
                      n_decoded=serving[i].generated if i < len(serving) else 0)
            for i in range(self._parallel))
        self.observability.batch_size.set(len(serving))
        self.observability.queue_depth.set(len(self._sequences) - len(serving))
