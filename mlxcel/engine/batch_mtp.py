"""The continuous batch's speculation as the worker keeps it, around the step itself, and the rule of K.

Whether the batch can speculate at all (and the sentence saying why not), the
rule of K (one for every width: a lone request's burst asks it too) with its
step costs restored from and saved beside the policy's hint, what the policy
endpoint publishes of it, and a row's joining with the drafter it ran with
alone. The step is :mod:`.batch_speculation`'s; the rule is
:mod:`mlxcel.policy.draft_length`'s. Worker thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from ..policy import HintStore, MtpPolicy, PairingKey
from ..policy.batch_view import BatchView
from ..policy.draft_length import DraftLength
from .requests import BurstStats
from .sequence import Sequence

if TYPE_CHECKING:
    from ..models.speculative import SequenceDrafter, Split
    from .batch_speculation import BatchSpeculation
    from .probe_memo import ProbeMemo
    from .speculation import Speculation

logger = logging.getLogger(__name__)

#: What the batch's speculation does is republished (when it changed) every this many batch steps...
PUBLISH_EVERY = 16
#: ... and its step costs written beside the policy's hint every this many (and when the worker stops)...
SAVE_EVERY = 4096
#: ... or every this many lone requests' bursts.
SAVE_EVERY_LONE = 16


class BatchMtp:
    """Speculation inside the continuous batch for the served pairing, or the reason there is none; and the
    rule of K wherever a burst can run (*batching* or not: a lone request's burst is its width 1)."""

    def __init__(self, model: Any, speculation: Speculation | None, layers: list[Any], pin: bool | None,
                 block_size: int, parallel: int, policy: MtpPolicy, hints: HintStore | None,
                 pairing: PairingKey | None, vocab: int, batching: bool = True, memo: ProbeMemo | None = None
                 ) -> None:
        self.policy, self.hints, self.pairing, self.batching = policy, hints, pairing, batching
        self.speculation: BatchSpeculation | None = None
        self.rule: DraftLength | None = None
        if speculation is not None and speculation.split is not None and pin is not False:
            self.rule = DraftLength(block_size - 1, forced=pin is True)
            self._restore()
        self.refusal = _refusal(speculation, layers, pin) if batching else "the server decodes one request at a time"
        self._steps = self._lone = 0
        if self.refusal is not None or speculation is None or speculation.split is None:
            logger.info("MTP runs for lone requests only: %s", self.refusal)
            return
        from ..models.speculative import BatchDraftHead
        from .batch_speculation import BatchSpeculation

        head = cast(BatchDraftHead, speculation.drafter)  # _refusal checked that it batches
        try:
            split = _batch_split(model, speculation, block_size, parallel)
            inexact = {} if speculation.decline is not None else _probe_widths(
                model, speculation, layers, block_size, parallel, split, vocab, memo)
        except Exception as exc:  # a probe that cannot run proves nothing: lone requests keep their burst
            # (seen on MLX's CUDA backend: a kernel the batch's shapes launch fails to build its CUDA graph)
            self.refusal = f"the batch's exactness probe could not run: {type(exc).__name__}: {exc}"
            logger.warning("MTP runs for lone requests only: %s", self.refusal)
            return
        self.speculation = BatchSpeculation(model, speculation.target, head, split)
        assert self.rule is not None
        self.rule.inexact = inexact

    def join(self, uid: int, sequence: Sequence, drafter: SequenceDrafter | None,
             speculation: Speculation | None) -> None:
        """*sequence* entered the batch as row *uid*: with its solo burst's *drafter* (its history), or the
        drafter state the prefix cache kept with its prompt, or none."""
        if self.speculation is None:
            return
        if drafter is None and sequence.drafter_state is not None and speculation is not None:
            drafter = speculation.drafter.new_sequence([])  # its own cache: the target's is not read
            drafter.restore(sequence.drafter_state)
        if sequence.burst is None:
            sequence.burst = BurstStats()  # its drafts in the batch count in its timings
        self.speculation.join(uid, drafter, sequence.chain, sequence.burst,
                              eligible=not sequence.processors and not sequence.request.logprobs)

    def stepped(self) -> None:
        """After a batch step: now and then, publish what the rule does and save its costs."""
        self._steps += 1
        if self._steps % PUBLISH_EVERY == 0:
            self.publish()
        if self._steps % SAVE_EVERY == 0:
            self.save()

    def lone_finished(self) -> None:
        """After a lone request's burst: publish what the rule does (width 1), and save its costs every
        :data:`SAVE_EVERY_LONE` such requests (a server serving one request at a time never steps a batch)."""
        self._lone += 1
        self.publish()
        if self._lone % SAVE_EVERY_LONE == 0:
            self.save()

    def publish(self) -> None:
        """What the rule of K does now at every width (a lone request's included, once the policy is not
        profiling: while it profiles every round drafts the most), to the policy endpoint (when it changed);
        nothing where the server does not batch."""
        cells = () if self.rule is None else tuple(
            c for c in self.rule.cells() if c.width > 1 or not self.policy.profiling)
        if not self.batching:
            view = None
        elif self.speculation is None:  # the rule's cells are a lone request's then (width 1)
            view = BatchView(False, self.refusal, cells)
        else:
            assert self.rule is not None
            view = BatchView(True, None, cells, tuple(sorted(self.rule.inexact.items())))
        if view != self.policy.snapshot.batch:
            self.policy.on_batch(view)

    def save(self) -> None:
        """The rule's step costs, beside the policy's hint (a failure warns and loses only the reuse)."""
        if self.hints is not None and self.pairing is not None and self.rule is not None and self.rule.cells():
            self.hints.save_batch(self.pairing, self.rule.export())

    def _restore(self) -> None:
        """The step costs an earlier run of this pairing measured under these kernels, if kept."""
        if self.hints is None or self.pairing is None or self.rule is None:
            return
        table = self.hints.load_batch(self.pairing)
        if table is None:
            return
        problem = self.rule.restore(table)
        if problem is not None:
            logger.warning("ignoring the batch's step costs in %s: %s", self.hints.batch_path_for(self.pairing),
                           problem)
        else:
            logger.info("restored the batch's step costs measured earlier (%d widths and depths)",
                        len(self.rule.cells()))


def _probe_widths(model: Any, speculation: Speculation, layers: list[Any], block_size: int, parallel: int,
                  split: Split, vocab: int, memo: ProbeMemo | None) -> dict[int, str]:
    """The batch widths (2 up to the batch's overflow place, ``parallel + 1``) whose verify is not byte for
    byte the batch's classic steps, each with why (logged): the classic step runs there. *vocab*: the token
    ids the probe's prompts and blocks draw from (the rows of the model's embedding). *memo*: what an earlier
    start found here, taken instead of probing, and where this one's is kept."""
    import time

    from .exactness import probe_batch_widths

    started = time.perf_counter()
    widths = range(2, parallel + 2)
    inexact = memo.batch(widths) if memo is not None else None
    if inexact is None:
        logger.info("MTP batch exactness probe: checking each batch width 2..%d against the batch's classic steps",
                    parallel + 1)
        reported = started

        def checked(width: int) -> None:  # at most a line a second: silent for small models, steady for large
            nonlocal reported
            if time.perf_counter() - reported >= 1.0 and width < widths.stop - 1:
                reported = time.perf_counter()
                logger.info("MTP batch exactness probe: %d of %d widths checked (%.0fs)", width - 1, len(widths),
                            reported - started)

        inexact = probe_batch_widths(speculation.target, model, layers, block_size, widths, split, vocab,
                                     checked=checked)
        if memo is not None:
            memo.save_batch(widths, inexact)
        done = f"checked in {time.perf_counter() - started:.1f}s"
    else:
        from .probe_memo import KEPT

        done = f"as {KEPT}"
    for width, detail in sorted(inexact.items()):
        logger.warning("MTP in the batch declines width %d: %s", width, detail)
    logger.info("MTP batch exactness probe: widths 2..%d %s, %d declined", parallel + 1, done, len(inexact))
    return inexact


def _batch_split(model: Any, speculation: Speculation, block_size: int, parallel: int) -> Split:
    """How the batch verifies: where the burst is exact, the ``rows`` split with the products a batch's block
    multiplies apart measured for every width up to *parallel* rows (a BLAS picks its kernel by a product's
    whole row count: the batch's (B, K) block is not K products of B rows, the classic step's, unless it is
    made so), and the attention a query at a time, as the classic step attends; under
    ``MLXCEL_MTP_ALLOW_INEXACT`` (the burst's probe vetoed), the burst's own split."""
    from ..models.row_exact import measure

    if speculation.decline is not None or speculation.split is None:
        return speculation.split or "wide"
    measure(model, block_size, max_batch=parallel + 1)  # the batch's overflow place is a row too
    return "rows"


def _refusal(speculation: Speculation | None, layers: list[Any], pin: bool | None) -> str | None:
    """Why the batch cannot speculate for this pairing, or None when it can."""
    from ..models.batch_rollback import batch_rollback_supported
    from ..models.speculative import batch_drafting, batches

    if speculation is None:
        return "no drafter configured"
    if pin is False:
        return "MTP is pinned off (MLXCEL_ENABLE_MTP_B1)"
    if speculation.split is None:
        return "the exactness probe vetoed the verify"
    if not batches(speculation.target):
        return "its target cannot roll a batch's rows back apart"
    if not batch_drafting(speculation.drafter):
        return "its drafter cannot draft for a batch's rows at once"
    return batch_rollback_supported(layers)
