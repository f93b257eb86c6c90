"""The worker's start: the model, its stream, the MTP set-up, and whether it batches. Worker thread only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..checkpoints import load_checkpoint
from ..families import BATCH_BROKEN
from ..hardware import HostInfo, detect_host
from ..models.loader import CheckpointInfo
from ..policy import HintStore, PairingKey
from .batch import batchable
from .messages import WorkerSettings
from .scheduler import Capabilities
from .speculation import Speculation

if TYPE_CHECKING:
    from .probe_memo import ProbeMemo

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Loaded:
    model: Any
    tokenizer: Any
    stream: Any
    """The MLX stream every call of the worker runs on."""
    eos_tokens: frozenset[int]
    vocab: int
    """The width of the model's logits."""
    embedding_rows: int
    """Token ids below this have an input embedding."""
    host: HostInfo
    speculation: Speculation | None
    capabilities: Capabilities
    new_cache: Callable[[], list[Any]]
    """A fresh prompt cache for the model: every sequence's, the probe's, the prefix cache's reference."""
    pairing: PairingKey | None = None
    """The MTP pairing configured (also when it cannot run), or None: no drafter."""
    sharded: bool = False
    """The model is sharded across processes (``--distributed``): what the policy's boot facts report."""
    release: Callable[[], None] = field(default=lambda: None)
    """What the worker calls as it ends (a sharded model tells the other ranks to stop)."""
    grammar_tokenizer: Any = None
    """llguidance's tokenizer for constrained decoding (``engine.grammar``), or a sentence saying why there
    is none."""
    probe_memo: ProbeMemo | None = None
    """The exactness probes' outcomes kept for a restart (the batch's probe reads and extends it), or None."""


def cache_maker(model: Any, kv_bits: int | None) -> Callable[[], list[Any]]:
    """What makes a fresh prompt cache for *model*: mlx-lm's, its plain KV layers quantized under
    ``--kv-bits`` (mlx-lm's ``QuantizedKVCache``: trimmable, read by mlx-lm's quantized attention)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    if kv_bits is None:
        return lambda: make_prompt_cache(model)

    def make() -> list[Any]:
        return [QuantizedKVCache(KV_GROUP_SIZE, kv_bits) if type(layer) is KVCache else layer
                for layer in make_prompt_cache(model)]
    return make


#: The quantized KV cache's group (mlx-lm's default): one scale and bias per 64 values of a head's vector.
KV_GROUP_SIZE = 64


def load(settings: WorkerSettings, checkpoint: CheckpointInfo, check: Callable[[], None],
         hints: HintStore | None = None) -> Loaded:
    """Load *checkpoint* and set up what serving it needs; *check* raises to abandon (a stop). *hints*: where
    the exactness probes' outcomes are kept for a restart (:mod:`.probe_memo`), if anywhere.

    With ``settings.sharding`` (rank 0 of ``--distributed``), this rank's shard, wrapped so that
    every call of it is mirrored by the other ranks (:mod:`mlxcel.distributed`).
    """
    sharding = settings.sharding
    if sharding is None:
        model, tokenizer = load_checkpoint(checkpoint, check=check)
        release: Callable[[], None] = lambda: None  # noqa: E731
    else:
        from ..distributed.load import load_leader

        model, tokenizer = load_leader(checkpoint, sharding)
        release = model.stop
    try:
        return _set_up(settings, checkpoint, model, tokenizer, release, check, hints)
    except BaseException:
        release()  # the other ranks wait for rank 0's calls: let them go
        raise


def _measure_products(model: Any, name: str, positions: int, widest: int) -> None:
    """Before any step runs (the exactness probe's included): which products this BLAS gives a row other
    bytes in beside other rows, up to *positions* a row and *widest* rows (CPU backend; elsewhere the
    probe measures what its verify needs), padded or chunked from then on (:mod:`~mlxcel.models.row_exact`)."""
    import time

    from ..models.row_exact import measure_steps

    started = time.perf_counter()
    split = measure_steps(model, widest, positions)
    if split is not None and (split.pads or split.chunks):
        logger.info("%s: %d weight shape(s) padded and %d chunked, so that a row's products are the same bytes "
                    "at any width up to %d x %d rows (measured in %.1fs)", name, len(split.pads), len(split.chunks),
                    widest, positions, time.perf_counter() - started)


def _turn_weights(model: Any, name: str) -> None:
    """The model's large float weights stored (in, out) for the BLAS (:mod:`~mlxcel.models.turned_weights`),
    before anything measures its products."""
    from ..models.turned_weights import turn

    turned = turn(model)
    if turned:
        logger.info("%s: %d float weight(s) stored (in, out) for the BLAS", name, turned)


def _set_up(settings: WorkerSettings, checkpoint: CheckpointInfo, model: Any, tokenizer: Any,
            release: Callable[[], None], check: Callable[[], None], hints: HintStore | None) -> Loaded:
    import mlx.core as mx

    _warn_if_slow_here(model, checkpoint.name)
    host = detect_host()
    sharding = settings.sharding
    if sharding is None:
        _turn_weights(model, checkpoint.name)
    else:  # a shard's ranks load their own layers: all of them keep mlx's layout alike
        host = replace(host, label=sharding.hardware_label(host.label))
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):  # one token through the model: the width of its logits
        vocab = int(model(mx.array([[0]])).shape[-1])
    new_cache = cache_maker(model, settings.kv_bits)
    if settings.kv_bits is not None:
        _check_quantized_cache(model, new_cache, stream, checkpoint.name, settings.kv_bits)
    # Batching needs caches that merge, and a batch mlx-lm gets right; without it (or with
    # --no-batch) sequences decode solo, one at a time, first come first served. A sharded
    # model decodes one sequence at a time too: its followers mirror one cache.
    broken = BATCH_BROKEN.get(checkpoint.model_type)
    if sharding is not None:
        broken = f"--distributed {sharding.mode}: the other ranks follow one sequence at a time"
    no_batch = "--no-batch" if not settings.batch else "--parallel 1" if settings.parallel < 2 else broken
    if no_batch is None and settings.kv_bits is not None:  # as mlx_lm.server's --kv-bits
        no_batch = f"--kv-bits {settings.kv_bits}: quantized KV caches do not merge into mlx-lm's batch"
    if no_batch is None and not batchable(model):
        no_batch = "its caches cannot be merged into a batch"
    if settings.batch and settings.parallel > 1 and no_batch is not None:
        logger.warning("%s: serving one sequence at a time (%s)", checkpoint.name, no_batch)
    drafts = settings.drafter is not None and settings.batch and sharding is None  # the burst is set up below
    memo = _probe_memo(hints, checkpoint, settings, host.label) if drafts and hints is not None else None
    widest = settings.parallel + 1 if no_batch is None else 1  # the batch's overflow place is a row too
    kept = memo.split(settings.block_size, widest if mx.default_device() == mx.cpu else 1) if memo else None
    if kept is not None:
        from ..models.row_exact import adopt
        from .probe_memo import KEPT

        adopt(model, kept)
        logger.info("%s: the row split %s", checkpoint.name, KEPT)
    else:
        _measure_products(model, checkpoint.name, settings.block_size if drafts else 1, widest)
        memo = _measured_for_the_probes(memo, model, settings.block_size)
    speculation = None
    pairing = None
    no_burst: str | None = "no drafter configured (--mtp, --draft-model)"
    if settings.drafter is not None and not settings.batch:
        no_burst = "--no-batch"
    if settings.drafter is not None and settings.batch and sharding is not None:
        # The burst's verify and rollback reach inside the model, which no follower could mirror.
        logger.warning("--distributed: the MTP burst does not run on a sharded model; %s is not loaded and "
                       "every request decodes classically", settings.drafter.name)
        pairing = PairingKey(checkpoint.name, settings.drafter.name, host.label, settings.block_size)
        no_burst = "the model is sharded across processes (--distributed)"
    elif drafts and settings.drafter is not None:  # with --no-batch no drafter is loaded
        from .speculation import set_up

        speculation = set_up(settings.drafter, checkpoint, model, stream, host.label, settings.block_size, vocab,
                             settings.policy.allow_inexact, settings.draft_quantize, check=check,
                             new_cache=new_cache, memo=memo)
        pairing = speculation.pairing
        no_burst = None if speculation.split is not None else speculation.decline or "the exactness probe vetoed it"
    check()
    capabilities = Capabilities(
        parallel=settings.parallel if no_batch is None else 1, no_batch=no_batch, no_burst=no_burst,
        # Scoring is a forward of its own, between the running sequence's: the other ranks would not
        # know which cache it runs on (mlxcel.distributed.mirror).
        no_prompt_scoring="the model is sharded across processes (--distributed)" if sharding else None)
    from .grammar import grammar_tokenizer

    eos = frozenset(tokenizer.eos_token_ids)
    return Loaded(model, tokenizer, stream, eos, vocab, _embedding_rows(model, vocab), host, speculation,
                  capabilities, new_cache, pairing, sharding is not None, release,
                  grammar_tokenizer(tokenizer, vocab, eos), memo)


def _probe_memo(hints: HintStore, checkpoint: CheckpointInfo, settings: WorkerSettings, hardware: str
                ) -> ProbeMemo | None:
    """What an earlier start's exactness probes found for this pairing here, and the row split measured before
    them (:mod:`.probe_memo`), or None where it cannot be told (a file that cannot be read: the probes run, as
    without a cache)."""
    from .probe_memo import ProbeMemo, fingerprint

    assert settings.drafter is not None
    try:
        probed = {"kv_bits": settings.kv_bits, "draft_quantize": settings.draft_quantize,
                  "context_length": checkpoint.context_length}
        return ProbeMemo(hints, PairingKey(checkpoint.name, settings.drafter.name, hardware, settings.block_size),
                         fingerprint(checkpoint.path, settings.drafter.path, probed))
    except Exception as exc:  # whatever goes wrong here means "probe", never a failed start
        logger.warning("probing exactness at every start: the probes' kept outcomes cannot be used (%s: %s)",
                       type(exc).__name__, exc)
        return None


def _measured_for_the_probes(memo: ProbeMemo | None, model: Any, block_size: int) -> ProbeMemo | None:
    """*memo*, with the row split kept in it: measured as the burst's probe first measures it, on every backend
    (the CPU's steps measured it already), since a kept outcome runs without the probe and its "rows" split
    needs the measurement. Where that raises, None (the probe's own measurement raises again, and vetoes)."""
    from ..models.row_exact import measure

    if memo is None:
        return None
    try:
        memo.save_split(measure(model, block_size))
        return memo
    except Exception as exc:
        logger.warning("probing exactness at every start: the row split cannot be kept (%s: %s)",
                       type(exc).__name__, exc)
        return None


def _check_quantized_cache(model: Any, new_cache: Callable[[], list[Any]], stream: Any, name: str, bits: int
                           ) -> None:
    """Three tokens through a quantized cache (a block, then a step), or a clear error: not every model runs
    on one (multi-head latent attention multiplies the cached keys itself; a head dimension must be a
    multiple of the group). A model that keeps no plain KV layer (its own cache classes) is served as it
    is, with a warning."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    cache = new_cache()
    if not any(isinstance(layer, QuantizedKVCache) for layer in cache):
        logger.warning("--kv-bits %d has no effect on %s: it keeps no plain KV cache to quantize", bits, name)
        return
    try:
        with mx.stream(stream):
            mx.eval(model(mx.array([[0, 1]]), cache=cache))
            mx.eval(model(mx.array([[2]]), cache=cache))
    except Exception as exc:
        raise ValueError(f"--kv-bits {bits}: {name} cannot run on a quantized KV cache "
                         f"({type(exc).__name__}: {exc}); serve it without --kv-bits") from exc


def _embedding_rows(model: Any, vocab: int) -> int:
    """Rows of the model's token embedding (``embed_tokens``, or gpt2's ``wte``, ...), else the logits' width.

    The smallest such table that a token id indexes: an id past it is read as garbage, not refused, by MLX.
    """
    import mlx.nn as nn

    rows = [module.weight.shape[0] for name, module in model.named_modules()
            if isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
            and name.rsplit(".", 1)[-1] in ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings",
                                           "embedding", "emb")]
    return min(rows, default=vocab)


def _warn_if_slow_here(model: Any, name: str) -> None:
    """Half-precision weights on the CPU backend serve correctly but slowly: say so, once, at start."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device() != mx.cpu:
        return
    leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    dtypes = {array.dtype for _, array in leaves if array.dtype in (mx.bfloat16, mx.float16)}
    if dtypes:
        logger.warning("%s has %s weights: on the CPU backend they compute correctly, but slower than float32 "
                       "(2-4x per matmul measured on x86); mlx-lm's convert --dtype float32 makes a faster copy",
                       name, "/".join(sorted(str(d).removeprefix("mlx.core.") for d in dtypes)))


def clear_device_cache() -> None:
    """An unloaded model's memory handed back to the system: mlx's cache of freed buffers emptied, and on glibc
    (Linux) the allocator's free pages returned (``malloc_trim``): mlx's CPU buffers come from ``malloc``, whose
    arenas keep freed memory resident otherwise (measured: 933 MB resident after every model was unloaded, 373 MB
    after the trim; docs/benchmarks.md)."""
    import ctypes
    import ctypes.util

    import mlx.core as mx

    mx.clear_cache()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


#: Tokens the cache cost is measured over: mlx-lm's KV cache grows by this many positions at a time.
COST_STEP = 256


def cache_cost(model: Any, new_cache: Callable[[], list[Any]]) -> tuple[int, float]:
    """What a sequence's cache holds: (the bytes after its first :data:`COST_STEP` tokens, its recurrent and
    convolution state and its KV's first allocation, which a reservation counts once as slack for the KV's
    allocation in steps; the bytes each further token adds), read on a fresh cache after :data:`COST_STEP`
    tokens and as many more. Shapes only: the forwards are never evaluated. (0, 0.0), said in the log, where a
    family's cache cannot be read so: its requests then reserve nothing. Worker thread only."""
    import mlx.core as mx

    try:
        cache = new_cache()
        sizes = []
        for _ in range(2):
            model(mx.zeros((1, COST_STEP), dtype=mx.int32), cache=cache)
            sizes.append(sum(c.nbytes for c in cache))
    except Exception as exc:  # a cache mlxcel cannot size this way: the budget counts its model's charge only
        logger.warning("cannot measure what a sequence's cache holds (%s: %s): requests reserve nothing for it",
                       type(exc).__name__, exc)
        return 0, 0.0
    first, grown = sizes
    return first, max(0.0, (grown - first) / COST_STEP)
