"""Setting up the B=1 burst at boot: the target adapter, the drafter, the exactness probe.

Worker thread only. Knows no family: the adapter and the drafter come from
:mod:`mlxcel.models.speculative` and :mod:`mlxcel.models.drafters`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checkpoints import load_drafter, speculative_target
from ..models.drafters import DrafterSpec
from ..models.loader import CheckpointInfo
from ..models.speculative import DESCRIBE, DraftHead, SpeculativeTarget, Split
from ..policy import PairingKey

if TYPE_CHECKING:
    from .exactness import ProbeResult
    from .probe_memo import ProbeMemo

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Speculation:
    """What the worker needs to run bursts for the served pairing."""

    target: SpeculativeTarget
    drafter: DraftHead
    split: Split | None
    """The verify split to run, or None: the probe vetoed and inexact bursts are not allowed."""
    pairing: PairingKey
    decline: str | None
    """The probe's veto sentence (None when exact)."""


def set_up(spec: DrafterSpec, checkpoint: CheckpointInfo, model: Any, stream: Any, hardware: str,
           block_size: int, vocab: int, allow_inexact: bool, draft_quantize: int | None = None,
           check: Callable[[], None] | None = None, new_cache: Callable[[], list[Any]] | None = None,
           memo: ProbeMemo | None = None) -> Speculation:
    """Load the drafter for *model*, probe the verify's exactness, and log what the probe found.

    *check* runs between the probe's steps and raises to abandon it (a server stopped while starting);
    that exception passes through, while any other failure of the probe is a veto (not kept). *new_cache*:
    the model's fresh cache as sequences get it (``--kv-bits``), mlx-lm's by default. *memo*: the outcome an
    earlier start found here, taken instead of probing, and where this one's is kept.
    """
    target = speculative_target(checkpoint.model_type, model)
    drafter = load_drafter(spec, checkpoint, model, quantize=draft_quantize)
    started = time.perf_counter()
    probe = memo.burst() if memo is not None else None
    if probe is None:
        probe = _probe(target, model, stream, block_size, vocab, checkpoint.context_length, check, new_cache)
        if memo is not None and not (probe.detail or "").startswith(_COULD_NOT_RUN):
            memo.save_burst(probe)
        done = f"{time.perf_counter() - started:.1f}s"
    else:
        from .probe_memo import KEPT

        done = KEPT
    split = probe.split
    if split is not None:
        logger.info("MTP exactness probe: at K=%d the burst is byte-identical to classic decode with %s "
                    "(every width 1..%d, every rollback prefix; %s)", block_size, DESCRIBE[split], block_size, done)
    elif allow_inexact:
        split = "wide"
        logger.warning("MLXCEL_MTP_ALLOW_INEXACT=1: running the burst although the exactness probe vetoed it; "
                       "temperature-0 output may differ from classic decode (byte identity is forfeited)")
    return Speculation(target, drafter, split, PairingKey(checkpoint.name, spec.name, hardware, block_size),
                       probe.detail)


#: How a veto that proves nothing begins (the probe failed to run): never kept for a restart.
_COULD_NOT_RUN = "The exactness probe could not run"


def _probe(target: SpeculativeTarget, model: Any, stream: Any, block_size: int, vocab: int, context_length: int,
           check: Callable[[], None] | None, new_cache: Callable[[], list[Any]] | None) -> ProbeResult:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .exactness import ProbeResult, probe_exactness

    logger.info("MTP exactness probe: checking every verify width up to K=%d against single-token decode",
                block_size)
    stopped: list[BaseException] = []

    def checked() -> None:
        if check is not None:
            try:
                check()
            except BaseException as exc:  # remembered, so that the veto below cannot swallow a stop
                stopped.append(exc)
                raise

    try:
        with mx.stream(stream):
            return probe_exactness(target, model, new_cache or (lambda: make_prompt_cache(model)), block_size,
                                   vocab, context_length, check=checked)
    except Exception as exc:  # a probe that cannot run proves nothing: no burst, and the server serves on
        if stopped:
            raise
        return ProbeResult(None, f"{_COULD_NOT_RUN}: {type(exc).__name__}: {exc}.")
