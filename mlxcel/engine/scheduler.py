"""The engine's decisions, pure: where each request goes, and what the worker does next.

No mlx, no trio (as :mod:`mlxcel.policy`): the worker hands the scheduler what
its inbox held and what ended, and applies the :class:`Intake` and
:class:`Turn` it gets back with MLX, isolating faults around each. Every rule
is a test without a model (``tests/engine/test_scheduler.py``). The rules:

- A request alone (nothing held, the only one in its drain) decodes *solo*: no
  batching machinery between it and the model, and the B=1 burst where allowed.
- Anything more joins the continuous batch; a solo sequence (started or not)
  moves into it, with its cache, as soon as another request arrives.
- Without a batch (``--no-batch``, ``--parallel 1``, caches that cannot merge, a
  sharded model, a batch that could not be rebuilt) the worker has one slot:
  sequences decode solo, one at a time, oldest first.
- The batch has ``parallel`` places; the others wait outside it. A free place
  goes to the waiting sequence whose request holds the fewest places, then the
  oldest: the ``n`` choices of one request cannot hold a later request back
  behind all of them.
- Nor behind those already decoding: while the places are full and some request
  holds more than one, a request holding none takes one *overflow* place beyond
  ``parallel``, at most one at a time (so the batch never exceeds
  ``parallel + 1``). A short request beside ``n=16`` long choices starts at
  once instead of waiting for the first choice to finish.
- A request whose prompt is to be scored (completions ``echo`` with ``logprobs``)
  is *scoring* first: a chunk of its prompt per scoring turn, the turns taking
  their fair share with the batch's (or a solo sequence's) steps, so a long
  prompt's scores never pause the others for more than a chunk. Scored, it
  decodes as any other arrival would: solo if it is alone, else from a place.
- Cancelled in the drain that submitted it: never admitted. A stop ends all.
- A request the model cannot serve (scoring a prompt on a sharded model) is
  refused at intake, with the reason :class:`Capabilities` gives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from .messages import Cancel, Message, Stop, Submit
from .requests import Finish, GenerationRequest, cancelled_unadmitted

Place = Literal["scoring", "solo", "waiting", "batch"]
"""Where a held sequence is: its prompt being scored, decoding (or to decode) alone, waiting for a place in the
batch, in the batch."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the loaded model can do, decided once at load. A ``no_*`` field is None where it can,
    else the sentence saying why not (for the log, the error, the status page)."""

    parallel: int = 1
    """Sequences that decode at once: ``--parallel`` when batching, else 1."""
    no_batch: str | None = "one slot"
    no_burst: str | None = "no drafter configured"
    """Why no B=1 MTP burst can run here (no drafter, a sharded model, the exactness probe's veto)."""
    no_prompt_scoring: str | None = None
    """Why the prompt's log-probabilities (completions ``echo`` with ``logprobs``) are not computed."""

    @property
    def batching(self) -> bool:
        return self.no_batch is None


def burst_allowed(capabilities: Capabilities, request: GenerationRequest, policy_allows: bool) -> bool:
    """Whether a solo *request* runs the MTP burst: the model can, the policy lets it run
    (``MtpPolicy.mtp_enabled``; at which K, round by round, is the draft-length rule's, which may run
    classic steps inside the burst), and it asked for nothing only classic decode gives (logprobs).
    Logits processors (bias, penalties, a grammar) do not gate: the burst applies them at every verify
    position."""
    return capabilities.no_burst is None and policy_allows and not request.logprobs


@dataclass(slots=True)
class Intake:
    """What a drain of the inbox means; the worker applies it in this order."""

    finished: list[tuple[str, Finish]] = field(default_factory=list)
    """Requests that end without ever being admitted (cancelled in their own drain, refused, stopped)."""
    stop: str | None = None
    """A stop: end every sequence held with this error (and return)."""
    cancelled: list[str] = field(default_factory=list)
    """Held requests whose clients went away."""
    to_batch: list[str] = field(default_factory=list)
    """A solo sequence to hand to the batch now, with its cache and the tokens it still has to feed."""
    admitted: list[tuple[GenerationRequest, Place]] = field(default_factory=list)
    """New requests, oldest first: "scoring", "solo" or "waiting" (for a place in the batch, given by :meth:`turn`)."""


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing held: wait for mail."""


@dataclass(frozen=True, slots=True)
class SoloTurn:
    request_id: str


@dataclass(frozen=True, slots=True)
class ScoreTurn:
    """Score the next chunk of this request's prompt; :meth:`Scheduler.scored` once it is whole."""

    request_id: str


@dataclass(frozen=True, slots=True)
class BatchTurn:
    """One step of the batch, after inserting these waiting sequences into the places that freed."""

    insert: tuple[str, ...] = ()


Turn = Idle | SoloTurn | BatchTurn | ScoreTurn


@dataclass(slots=True)
class _Held:
    request: GenerationRequest
    place: Place


def _group(request: GenerationRequest) -> str:
    return request.group or request.id


class Scheduler:
    """The worker's book of held requests, in arrival order, and its rules (the module docstring)."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self._held: dict[str, _Held] = {}
        self._scored_last = False  # the last turn was a scoring turn: the next goes to the decoders, if any

    @property
    def held(self) -> int:
        return len(self._held)

    def place(self, request_id: str) -> Place | None:
        held = self._held.get(request_id)
        return held.place if held is not None else None

    def take(self, messages: Iterable[Message]) -> Intake:
        """Decide what the messages of one drain of the inbox mean (see :class:`Intake`)."""
        intake = Intake()
        submitted: dict[str, GenerationRequest] = {}
        for message in messages:
            if isinstance(message, Stop):
                intake.stop = message.reason
                intake.finished += [(r.id, Finish("error", len(r.prompt_tokens), 0, error=message.reason))
                                    for r in submitted.values()]
                self._held.clear()
                return intake
            if isinstance(message, Submit):
                submitted[message.request.id] = message.request
            elif isinstance(message, Cancel) and message.request_id in submitted:
                request = submitted.pop(message.request_id)
                intake.finished.append((request.id, cancelled_unadmitted(request)))
            elif self._held.pop(message.request_id, None) is not None:
                intake.cancelled.append(message.request_id)
        arrivals = [r for r in submitted.values() if not self._refused(r, intake)]
        if not arrivals:
            return intake
        alone = not self._held and len(arrivals) == 1
        batching = self.capabilities.batching and not alone
        if batching:
            for request_id, held in self._held.items():
                if held.place == "solo":
                    held.place = "batch"
                    intake.to_batch.append(request_id)
        for request in arrivals:
            place: Place = "scoring" if request.prompt_logprobs else "waiting" if batching else "solo"
            self._held[request.id] = _Held(request, place)
            intake.admitted.append((request, place))
        return intake

    def _refused(self, request: GenerationRequest, intake: Intake) -> bool:
        why = self.capabilities.no_prompt_scoring
        if request.prompt_logprobs and why is not None:
            intake.finished.append((request.id, Finish(
                "error", len(request.prompt_tokens), 0, error_type="invalid_request_error",
                error=f"the prompt's log-probabilities (echo with logprobs) are not computed here: {why}")))
            return True
        return False

    def turn(self) -> Turn:
        """What the worker does next: score a prompt's chunk, decode a solo sequence, step the batch, or wait
        for mail. Scoring turns and the others take turns."""
        scoring = next((request_id for request_id, held in self._held.items() if held.place == "scoring"), None)
        decoding = [(request_id, held) for request_id, held in self._held.items() if held.place != "scoring"]
        if scoring is not None and not (self._scored_last and decoding):
            self._scored_last = True
            return ScoreTurn(scoring)
        self._scored_last = False
        if not decoding:
            return Idle()
        if not self.capabilities.batching:
            return SoloTurn(decoding[0][0])  # one slot: the oldest, to its end
        if len(decoding) == 1 and decoding[0][1].place == "solo":
            return SoloTurn(decoding[0][0])
        return BatchTurn(self._fill_places())

    def scored(self, request_id: str) -> None:
        """*request_id*'s prompt is scored: it decodes alone if nothing else is held (or there is one slot),
        else it waits for a place in the batch."""
        held = self._held[request_id]
        alone = len(self._held) == 1
        held.place = "waiting" if self.capabilities.batching and not alone else "solo"

    def _fill_places(self) -> tuple[str, ...]:
        """Give the batch's free places to waiting sequences, fewest places held by their request first; then
        the overflow place, if a request holding none waits behind another's extra choices."""
        holding: dict[str, int] = {}
        for held in self._held.values():
            if held.place == "batch":
                holding[_group(held.request)] = holding.get(_group(held.request), 0) + 1
        free = self.capabilities.parallel - sum(holding.values())
        waiting = [(request_id, held) for request_id, held in self._held.items() if held.place == "waiting"]
        chosen: list[str] = []
        while free > 0 and waiting:
            # min() keeps the first of equals: arrival order breaks ties.
            index = min(range(len(waiting)), key=lambda i: holding.get(_group(waiting[i][1].request), 0))
            request_id, held = waiting.pop(index)
            held.place = "batch"
            holding[_group(held.request)] = holding.get(_group(held.request), 0) + 1
            chosen.append(request_id)
            free -= 1
        if free == 0 and any(count > 1 for count in holding.values()):
            newcomer = next((i for i, (_, held) in enumerate(waiting) if _group(held.request) not in holding), None)
            if newcomer is not None:  # the overflow place (module docstring)
                request_id, held = waiting.pop(newcomer)
                held.place = "batch"
                chosen.append(request_id)
        return tuple(chosen)

    def ended(self, request_id: str) -> None:
        """*request_id* left the worker (finished, failed, could not be admitted). Idempotent."""
        self._held.pop(request_id, None)

    def batch_lost(self, why: str) -> None:
        """The batch could not be rebuilt: one slot from now on, every held sequence solo."""
        self.capabilities = replace(self.capabilities, parallel=1, no_batch=why)
        for held in self._held.values():
            if held.place != "scoring":
                held.place = "solo"
