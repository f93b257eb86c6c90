"""What goes into the engine and what comes back. Plain data: no mlx, no trio."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..models.images import PromptImage
from ..policy import BurstSample

FinishReason = Literal["stop", "length", "cancelled", "error"]

#: Below this temperature ``1 / temperature`` overflows the logits: such a request is greedy.
GREEDY_BELOW = 1e-5
ErrorType = Literal["server_error", "invalid_request_error"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    min_p: float = 0.0
    """0 disables min-p (a filter of the sampling chain, so the burst's sampler applies it too)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value added to its logit) pairs."""
    repetition_penalty: float = 1.0
    """1 is off; otherwise mlx-lm's sign-aware multiplicative penalty over the last tokens."""
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int | None = None
    """None: OpenAI's meaning, every token generated so far (not the prompt); a number: mlx-lm's window of the
    last tokens, prompt included."""
    frequency_penalty: float = 0.0
    frequency_context_size: int | None = None
    """As *presence_context_size*."""
    grammar: Any = None
    """Constrained decoding: an llguidance ``LLMatcher`` at the start of its grammar, this sequence's own.
    Compiled by the HTTP layer (mlxcel.server.matchers), so the worker never compiles."""

    @property
    def has_processors(self) -> bool:
        """Whether the logits pass through processors (bias, penalties, a grammar) before sampling.

        Every decode path applies them (the MTP burst at every verify position).
        """
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.presence_penalty) \
            or bool(self.frequency_penalty) or self.grammar is not None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first occurrence, which is not returned."""
    logprobs: bool = False
    top_logprobs: int = 0
    """With *logprobs*: this many most likely alternatives per token, with their log-probabilities."""
    prompt_logprobs: bool = False
    """Score the prompt too (completions ``echo`` with ``logprobs``): a :class:`PromptLogprobs` comes first,
    with *top_logprobs* alternatives per position."""
    group: str = ""
    """The client request it is one choice of (``n``, ``best_of``), which the scheduler shares places among
    fairly; empty: a request of its own."""
    images: tuple[PromptImage, ...] = ()
    """A vision model's images, one per image span of the prompt, in order: the prompt is prefilled whole with
    their features at admission, unless the prefix cache holds all of its images, where its keys hold the
    images' hashes in place of their tokens (:func:`~mlxcel.models.images.image_keys`)."""
    checkpoints: tuple[int, ...] = ()
    """Prompt positions a later prompt is likely to share the tokens before (the end of a chat's system
    prompt, the end of its conversation before the generation prompt): a cache that cannot be rewound is
    kept there (:meth:`~.prefix_cache.PrefixCache.snapshot`), as it is at the end of the prompt."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New output of one request: text and the tokens behind it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per token, the request's ``top_logprobs`` most likely (id, log-probability), most likely first."""


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's own log-probabilities: of each prompt token after the first, given the tokens before it.

    The model's distribution itself (the prompt was not sampled: no bias, penalty or grammar applies).
    """

    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per position, the request's ``top_logprobs`` most likely (id, log-probability), most likely first."""


@dataclass(frozen=True, slots=True)
class Timings:
    """Per-request timings and draft statistics, in llama.cpp's names."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cached_n: int = 0
    """Prompt tokens reused from the prefix cache."""
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_rounds: int = 0
    draft_widths: tuple[int, ...] = ()
    """The batch widths it drafted at, ascending (1: alone, the B=1 burst); empty when it never drafted."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The last event of every request."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings = field(default_factory=Timings)
    error: str | None = None
    """Why the request ended early (reason ``error`` or ``cancelled``)."""
    error_type: ErrorType = "server_error"
    """Whose fault an ``error`` finish is: the server's (HTTP 500) or the request's (HTTP 400)."""
    stop_sequence: str | None = None
    """The stop string that ended the text (reason ``stop``), if one did (Anthropic's ``stop_sequence``)."""


Event = TextDelta | Finish | PromptLogprobs

#: Why a cancelled request ended.
CLIENT_GONE = "the client went away"


def cancelled_unadmitted(request: GenerationRequest) -> Finish:
    """The finish of *request* cancelled before the worker admitted it: nothing generated."""
    return Finish("cancelled", len(request.prompt_tokens), 0, error=CLIENT_GONE)


@dataclass
class BurstStats:
    """One request's burst, as the policy samples it."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    round_seconds: float = 0.0
    classic_steps: int = 0
    classic_seconds: float = 0.0
    classic_samples: int = 0
    """Timings of classic decode taken (each of several pipelined steps)."""
    depth: int = 0
    """Tokens of context when the burst started."""
    widths: set[int] = field(default_factory=set)
    """The batch widths its rounds ran at (1: alone)."""

    def sample(self) -> BurstSample:
        """The policy's frozen record of this burst."""
        return BurstSample(rounds=self.rounds, proposed=self.proposed, accepted=self.accepted,
                           round_seconds=self.round_seconds, classic_steps=self.classic_steps,
                           classic_seconds=self.classic_seconds, depth=self.depth)
