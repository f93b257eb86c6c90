"""The worker's record of one request it is serving. Plain data; worker thread only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .output import SequenceOutput
from .requests import BurstStats, GenerationRequest

if TYPE_CHECKING:
    from .instrument import Probe
    from .prompt_scoring import PromptScorer
    from .sampling import SamplingChain
    from .solo import SoloDecoder


@dataclass
class Sequence:
    """A request the worker is serving: its prompt being scored (``scorer``), waiting (``prompt_state``), alone
    (``solo``) or in the batch."""

    request: GenerationRequest
    output: SequenceOutput
    chain: SamplingChain | None
    """The request's sampling chain (None: greedy); the burst's acceptance rule draws from the same one,
    so a seeded request never reuses a key."""
    sampler: Callable[[Any], Any] | None
    """What classic decode calls: the chain (with the test instrument around it, if any)."""
    admitted: float
    processors: list[Callable[[Any, Any], Any]]
    """mlx-lm's logits processors for its bias and penalties, then its grammar (empty: none); every decode
    path applies them (solo, the batch, the burst)."""
    cached: int
    """Prompt tokens reused from the prefix cache."""
    solo: SoloDecoder | None = None
    prompt_state: tuple[Any, list[int], list[int]] | None = None
    """(prefix cache, its tokens, tokens still to prefill) of a sequence waiting for its solo turn."""
    drafter_state: Any = None
    """The MTP drafter's state the prefix cache kept with the cache it resumes from, if any."""
    scorer: PromptScorer | None = None
    """What scores its prompt (completions ``echo`` with ``logprobs``) until the scores are delivered."""
    ever_batched: bool = False
    """Decoded in the batch (B>1) at some point: then its burst is not a policy sample."""
    burst: BurstStats | None = None
    """Its MTP burst's statistics, if it ran one."""
    probe: Probe | None = None
    """The test instrument bound to its request (None without one): what its decoders call at their points."""

    def grammar_failure(self) -> Exception | None:
        """Why its grammar could not go on in the last batch step, if it could not (see GrammarProcessor.deferring)."""
        failures = (getattr(p, "failure", None) for p in self.processors)
        return next((failure for failure in failures if failure is not None), None)


def new_sequence(request: GenerationRequest, tokenizer: Any, eos_tokens: frozenset[int], cached: int,
                 probe: Probe | None) -> Sequence:
    """The worker's record of *request*: its sampling chain, its logits processors, its output.

    *cached*: prompt tokens the prefix cache holds. *probe*: the test instrument, if any (then the
    sampler calls it at ``"sampler"`` first).
    """
    import time

    from mlx_lm.sample_utils import greedy_sampler

    from .grammar import GrammarProcessor
    from .sampling import make_processors, make_sampler

    prompt = len(request.prompt_tokens)
    chain = make_sampler(request.sampling)
    sampler: Callable[[Any], Any] | None = chain
    if probe is not None:
        inner = chain or greedy_sampler

        def sampler(logprobs: Any) -> Any:
            probe("sampler")
            return inner(logprobs)

    processors = make_processors(request.sampling, prompt)
    if request.sampling.grammar is not None:  # last: it masks what the others computed
        processors.append(GrammarProcessor(request.sampling.grammar, prompt))
    return Sequence(request=request, chain=chain, sampler=sampler, processors=processors,
                    output=SequenceOutput(request, tokenizer.detokenizer, eos_tokens),
                    admitted=time.perf_counter(), cached=cached, probe=probe)
