"""What the B=1 MTP burst needs of a model family: a speculative target and a drafter.

The engine knows these protocols and nothing of any family. A family adds a
*target adapter* (the model's exact logits with the hidden states its drafter
reads; a K-wide verify that keeps what a rollback needs; a rollback to any
accepted prefix) and/or a *drafter* (catch up on target hidden states, draft
K-1 tokens on device, accept what the target kept), in its own folder of
:mod:`mlxcel.families`.

Shapes: token blocks are ``(1, S)``; logits ``(1, S, V)``; hidden ``(1, S, H)``.
Everything here runs on the engine's worker thread, lazily: nothing is read
back to the host, so a round is one graph the device runs while the worker
handles the previous round's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

#: A drafter that defers its catch-up (single steps are best read together) has what it queued read once it
#: holds this many positions, while the target decodes classically (a lone burst's classic steps, the batch's).
SETTLE_EVERY = 64

Split = Literal["wide", "rows", "half"]
"""How a verify block is computed: one K-wide forward; the same with the matmuls this BLAS multiplies
inexactly done a row at a time and the causal attention a query at a time (:mod:`.row_exact`); or two
forwards of at most ceil(K/2) tokens."""
SPLITS: tuple[Split, ...] = ("wide", "rows", "half")
DESCRIBE: dict[Split, str] = {
    "wide": "one K-wide verify forward",
    "rows": "row-split verify (one K-wide forward, the matmuls whose multi-row products differ on this BLAS a row "
            "at a time, and the attention a query at a time)",
    "half": "half-width verify (the K-wide block in two forwards of at most ceil(K/2) tokens)",
}


def split_forward(forward: Callable[[Any, list[Any]], tuple[Any, Any]], tokens: Any, cache: list[Any],
                  split: Split, model: Any) -> tuple[Any, Any]:
    """*forward* (tokens, cache) -> (logits, hidden) over a verify block under *split*: one forward
    (``wide``; ``rows``, with :func:`.row_exact.rows_apart` of *model*, the mlx-lm model *forward* runs),
    or (``half``, blocks of three or more) two of at most ceil(K/2) tokens, their outputs joined."""
    import mlx.core as mx

    width = tokens.shape[1]
    if split == "rows":
        from .row_exact import rows_apart

        # A batch's caches (left-padded rows, right-justified at one index) make every mask array's query
        # see a prefix of the keys, as the batch's step at its position did.
        with rows_apart(model, batch=any(getattr(c, "left_padding", None) is not None for c in cache)):
            return forward(tokens, cache)
    if split == "wide" or width <= 2:
        return forward(tokens, cache)
    half = (width + 1) // 2
    first, second = forward(tokens[:, :half], cache), forward(tokens[:, half:], cache)
    return mx.concatenate([first[0], second[0]], axis=1), mx.concatenate([first[1], second[1]], axis=1)


class Verify(Protocol):
    """One verify forward's result: what the acceptance rule reads, and what a rollback restores."""

    @property
    def logits(self) -> Any:
        """(1, W, V), byte for byte what the single-token chain would give."""
        ...

    @property
    def hidden(self) -> Any:
        """(1, W, H): what the drafter reads."""
        ...


@dataclass(frozen=True, slots=True)
class BlockVerify:
    """A :class:`Verify` whose rollback needs only the block's width (caches that trim); a family whose
    rollback needs more (recurrent states, convolution inputs) subclasses it with that."""

    logits: Any
    hidden: Any
    width: int


class SpeculativeTarget(Protocol):
    """The served model as the burst drives it."""

    def forward(self, tokens: Any, cache: list[Any]) -> tuple[Any, Any]:
        """(logits, hidden) for *tokens* appended to *cache*; logits byte for byte ``model(tokens, cache)``'s."""
        ...

    def verify(self, tokens: Any, cache: list[Any], split: Split) -> Verify:
        """:meth:`forward` of a block, keeping whatever :meth:`rollback` needs to undo part of it."""
        ...

    def rollback(self, cache: list[Any], verify: Any, kept: int) -> None:
        """Leave *cache* exactly as if only the first *kept* tokens of *verify*'s block had been fed."""
        ...


class BatchTarget(SpeculativeTarget, Protocol):
    """A target that can also roll back the rows of a batch apart (speculation inside the continuous batch)."""

    def rollback_rows(self, cache: list[Any], verify: Any, kept: list[int]) -> None:
        """Leave row i of the batch's *cache* as if only the first *kept[i]* tokens of its block had been fed."""
        ...


def batches(target: SpeculativeTarget) -> bool:
    """Whether *target* can speculate inside the continuous batch (it rolls rows back apart)."""
    return callable(getattr(target, "rollback_rows", None))


class SequenceDrafter(Protocol):
    """One sequence's drafter state (its own cache, if it has one)."""

    @property
    def ready(self) -> bool:
        """Whether it has a target hidden state to draft from."""
        ...

    def catch_up(self, hidden: Any, tokens: Any) -> None:
        """Take target hidden states at positions i with the tokens at i+1, (1, S, H) and (1, S).

        May defer the work (single steps are best read together, at the next draft).
        """
        ...

    def settle(self) -> list[Any]:
        """Do the deferred catch-up now; the arrays to evaluate with the target's prefill chunk, so
        that a long prompt is caught up chunk by chunk, never in one forward."""
        ...

    def draft(self, count: int) -> Any:
        """*count* greedy draft tokens, shape (1, count), built on device without a host sync."""
        ...

    def accept(self, hidden: Any, tokens: Any, drafted: int) -> None:
        """After a round that drafted *drafted* tokens: forget the chain, catch up on what was kept."""
        ...

    def snapshot(self) -> Any:
        """What it holds, settled, as a value a later :meth:`restore` (of another sequence's drafter on a copy
        of the same target cache) takes: the prefix cache keeps it beside a snapshot of the target's cache."""
        ...

    def restore(self, state: Any) -> None:
        """Hold *state* (from :meth:`snapshot`) instead of what it holds."""
        ...


class DraftHead(Protocol):
    """A loaded drafter: shared weights, and a fresh state per sequence."""

    def new_sequence(self, cache: list[Any]) -> SequenceDrafter:
        """A drafter for one sequence whose target cache is *cache* (the same list the target's
        forward and verify append to). A drafter with a cache of its own ignores it; one that
        attends into the target's keys and values (Gemma 4's assistant) reads them there."""
        ...


class BatchDrafter(Protocol):
    """The drafter of a continuous batch's rows, drafting for all of them at once. Rows are named by the
    batch's uids; every call that takes *uids* takes them in the batch's row order."""

    def join(self, uid: int, sequence: Any) -> None:
        """Row *uid* joins, with the state of the :class:`SequenceDrafter` it ran with alone, or None."""
        ...

    def leave(self, uid: int) -> None: ...

    def ready(self, uid: int) -> bool:
        """Whether row *uid* has a target hidden state to draft from."""
        ...

    def pending(self, uid: int) -> int:
        """Positions queued for row *uid* and not read yet."""
        ...

    def catch_up(self, uid: int, hidden: Any, tokens: Any) -> None:
        """Row *uid*'s target hidden states (1, S, H) with the tokens after them (1, S)."""
        ...

    def settle(self, uids: list[int]) -> list[Any]:
        """Read what is queued now; the arrays to evaluate."""
        ...

    def draft(self, uids: list[int], count: int, cache: list[Any]) -> Any:
        """*count* greedy drafts per row, (B, count), on device; *cache* is the batch's target cache (a
        drafter that attends into the target's keys and values reads them there)."""
        ...

    def accept(self, uids: list[int], hidden: Any, tokens: Any, kept: list[int], drafted: int) -> None:
        """After a step of *drafted* drafts per row: row i kept the first *kept[i]* positions of *hidden*
        (B, W, H), each followed by the token at that place of *tokens* (B, W)."""
        ...


class BatchDraftHead(DraftHead, Protocol):
    """A drafter that can also draft for a batch's rows at once."""

    def new_batch(self) -> BatchDrafter: ...


def batch_drafting(head: DraftHead) -> bool:
    """Whether *head* can draft for a continuous batch's rows at once."""
    return callable(getattr(head, "new_batch", None))
