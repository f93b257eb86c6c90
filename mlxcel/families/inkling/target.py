"""Inkling as a speculative target: the model of :mod:`mlxcel.families.inkling.model`, verified and rolled back.

A verify asks each layer's :class:`~mlxcel.families.inkling.model.InklingCache` to keep its convolutions'
inputs over the block (``windows``); a rollback trims the keys and values and takes each
convolution's state as the slice of those inputs that ends at the last kept token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ...models.speculative import BlockVerify, split_forward
from .model import Model


@dataclass(frozen=True, slots=True)
class InklingVerify(BlockVerify):
    windows: list[dict[str, mx.array]]
    """Per layer, each convolution's inputs: its state before the block, then the block's."""


class InklingTarget:
    """The :class:`~mlxcel.models.speculative.SpeculativeTarget` of an Inkling model.

    Hidden is the PRE-final-norm residual stream, which the MTP head reads. Rollback: the
    keys/values are trimmed, and each convolution's state after the kept prefix is a slice of
    the inputs the verify saw anyway: nothing is recomputed or copied per token. Chosen over
    snapshot and replay (restore the caches from before the verify, run the kept tokens again)
    by measurement (``benchmarks/inkling_rollback.py``, a 337 MB Inkling, docs/benchmarks.md): a
    round with a rejection costs 0.47-0.60 of the replay's, and a round that rejects nothing
    costs the same within noise (keeping the inputs is a few small concatenations).
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.kernel = model.args.conv_kernel_size
        args = model.args
        #: Where the exactness probe also verifies: a block crossing the sliding window's edge and the
        #: full layers' relative extent (past it a key's bias is zero, not read from the profile).
        self.probe_offsets = (args.sliding_window_size - 2, args.rel_extent - 2)

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        hidden = self.model.model(tokens, cache)
        return self.model.logits(hidden), hidden

    def verify(self, tokens: mx.array, cache: list[Any], split: Any) -> InklingVerify:
        for c in cache:
            c.windows = {}
        try:
            width = tokens.shape[1]
            self._stepwise(split == "rows")
            logits, hidden = split_forward(self.forward, tokens, cache, split, self.model)
            return InklingVerify(logits, hidden, width, [c.windows for c in cache])
        finally:
            self._stepwise(False)
            for c in cache:
                c.windows = None

    def _stepwise(self, on: bool) -> None:
        """A row-split verify's part in this family's own code: attention over each query's own keys and
        the router a row at a time (what ``rows_apart`` does for mlx-lm's layers and fused attention)."""
        for layer in self.model.model.layers:
            layer.self_attn.stepwise = on
            if hasattr(layer.mlp, "stepwise"):
                layer.mlp.stepwise = on

    def rollback(self, cache: list[Any], verify: InklingVerify, kept: int) -> None:
        dropped = verify.width - kept
        if dropped == 0:
            return
        for c, windows in zip(cache, verify.windows, strict=True):
            c.kv.trim(dropped)
            c.conv = {name: window[:, kept:kept + self.kernel - 1, :] for name, window in windows.items()}
