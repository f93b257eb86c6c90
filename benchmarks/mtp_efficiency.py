"""MTP efficiency at a realistic size: the burst's measured speedup against its ideals, and where a round goes.

    python -m benchmarks.mtp_efficiency [--layers 24 --hidden 1024] [--k 2 3 4] [--tokens 48] [--chunk 12]
                                        [--contexts 0.0 0.001 0.003] [--passes 3] [--depths 0 8192]

In process, no server: the engine's own pieces (``SoloDecoder``, ``Burst``, the Qwen 3.5 target
adapter and its in-checkpoint head, loaded as the worker loads them, on a stream of their own), and
the verify split the exactness probe picks at each K (where it vetoes, the wide verify is measured
anyway, as ``MLXCEL_MTP_ALLOW_INEXACT=1`` would run it). For each target (``_common.mtp_model``; its
*context* sets how often the head agrees) and each K, a pass decodes four sequences side by side,
*--chunk* tokens each in turn (so that on a shared, noisy machine the sides are seconds apart):

- **classic**: B=1 pipelined classic decode as the solo path runs it (``classic_steps``): seconds
  between tokens; this is the *step*, the unit of every cost printed;
- **mlx-lm**: ``mlx_lm.stream_generate`` on its own copy of the same checkpoint, the same way;
- **MTP**: real ``Burst`` rounds, pipelined as ``engine/burst_loop.run_burst`` runs them (the next
  round dispatched as soon as one is read back): seconds per token emitted;
- **instrumented**: the same rounds with the drafter and the target wrapped so that each stage is
  evaluated where it ends: *draft* (the head's catch-up and its K-1 steps), *attention* (the verify's
  attention calls, each evaluated alone, its inputs first), *verify* (the rest of the K-wide forward
  under the split: the products), *sync* (what the read-back still waits for: the acceptance
  argmaxes), *rollback* (caches cut back to the kept tokens) and *python*, the rest of the round's
  wall time: building the graphs, acceptance, bookkeeping. None of it overlaps the device in a round,
  while a classic step builds the next step as the device runs this one. A classic step's own
  attention is timed the same way on a copy of the classic side (*attn/step*).

*--depths*: tokens of words before the prompt (the model's window grows to fit). Each (target, depth)
is prefilled once, with the drafter; every side starts from a copy of that state (the caches and the
head's), mlx-lm's ``stream_generate`` included (given the copy as its ``prompt_cache``), so a deep
prompt is prefilled once, not once per side and K.

Printed per K: acceptance, tokens per round (tok/r), MTP tokens/s, the measured speedup (classic
step / MTP seconds per token, median of the paired chunks), the ideal from measured costs (tok/r /
(verify + draft), in steps) and the measured speedup's fraction of it, the pure ideal (tok/r) and
the fraction of that, MTP / mlx-lm classic, and each stage of a full-width round in steps.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.blas import load_fast_blas

BLAS = load_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks._common import context_window, median, mtp_model, words  # noqa: E402
from mlxcel.checkpoints import (  # noqa: E402  # noqa: E402
    inspect_checkpoint,
    inspect_drafter,
    load_checkpoint,
    load_drafter,
    speculative_target,
)
from mlxcel.engine.burst import Burst  # noqa: E402
from mlxcel.engine.exactness import probe_exactness  # noqa: E402
from mlxcel.engine.solo import SoloDecoder  # noqa: E402
from mlxcel.models.attention import mlx_thread  # noqa: E402
from mlxcel.models.speculative import Split  # noqa: E402

PROMPT = "def wrap(text, width=70):"
STAGES = ("draft", "attention", "verify", "sync", "rollback", "python")


@dataclass
class Served:
    """One checkpoint as the worker holds it with ``--mtp``, and mlx-lm's own copy of it."""

    model: Any
    target: Any
    head: Any
    reference: Any
    tokenizer: Any
    stream: Any = field(default_factory=lambda: mx.new_stream(mx.default_device()))


def load(path: Path) -> Served:
    info = inspect_checkpoint(path)
    model, _ = load_checkpoint(info)
    head = load_drafter(inspect_drafter(info, mtp=True, draft_model=None), info, model)
    reference, reference_tokenizer = mlx_lm.load(str(path))
    return Served(model, speculative_target(info.model_type, model), head, reference, reference_tokenizer)


def deep_prompt(served: Served, depth: int) -> list[int]:
    """*depth* tokens (within a word's) of code-ish words, then the prompt."""
    filler = words(served.tokenizer, depth, random.Random(0)) + "\n" if depth else ""
    return list(served.tokenizer.encode(filler + PROMPT))


def probe_splits(served: Served, ks: list[int], context_length: int) -> dict[int, Split | None]:
    """The verify split the exactness probe picks at each K (None: vetoed), as the worker runs it at boot.

    Smallest K first: a probe at K checks every width up to K under each split, and a larger K's
    rounds run those same forwards, so once one K is vetoed every larger one is too.
    """
    vocab = int(served.model(mx.array([[0]])).shape[-1])
    splits: dict[int, Split | None] = {}
    for k in sorted(ks):
        if None in splits.values():
            splits[k] = None
            continue
        started = time.perf_counter()
        with mx.stream(served.stream):
            probe = probe_exactness(served.target, served.model, lambda: make_prompt_cache(served.model), k,
                                    vocab, context_length)
        splits[k] = probe.split
        print(f"  exactness probe at K={k} ({time.perf_counter() - started:.0f}s): "
              f"{probe.split or 'vetoed'}{': ' + probe.detail if probe.detail else ''}", flush=True)
    return splits


@dataclass
class Start:
    """A prompt prefilled once, with the drafter: what every side of a measurement starts from."""

    decoder: SoloDecoder
    head_state: Any


def prefill(served: Served, prompt: list[int], split: Split) -> Start:
    cache = make_prompt_cache(served.model)
    solo = SoloDecoder(served.model, served.stream, None, cache, [], list(prompt),
                       burst=Burst(served.target, served.head.new_sequence(cache), split, None))
    with mx.stream(served.stream):
        while not solo.prefilled:
            solo.prefill_chunk(512)
        assert solo.burst is not None
        return Start(solo, solo.burst.drafter.snapshot())


def copied(served: Served, start: Start, burst_of: Callable[[list[Any]], Burst] | None = None) -> SoloDecoder:
    """A sequence in *start*'s state, its own caches (and, with *burst_of*, a head in *start*'s state)."""
    base = start.decoder
    cache = copy.deepcopy(base.cache)
    burst = None
    if burst_of is not None:
        burst = burst_of(cache)
        burst.drafter.restore(start.head_state)
    return SoloDecoder(served.model, served.stream, None, cache, list(base.tokens_in_cache), list(base.pending),
                       burst=burst)


def classic_chunk(solo: SoloDecoder, tokens: int) -> float:
    """Seconds per step of *tokens* pipelined classic steps, between the first and the last token read back."""
    stamps: list[float] = []
    solo.classic_steps(tokens, False, lambda token: stamps.append(time.perf_counter()) is not None)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def mlx_lm_chunk(generator: Iterator[Any], tokens: int) -> float:
    """Seconds per step of the next *tokens* of a ``stream_generate``, between the first and the last."""
    stamps = []
    for _ in range(tokens):
        if next(generator, None) is None:
            raise RuntimeError("mlx-lm reached an end of sequence: choose another prompt")
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def burst_rounds(solo: SoloDecoder, k: int, tokens: int, on_round: Callable[[float], None] | None = None) -> float:
    """Rounds until *tokens* more are out, pipelined as ``run_burst`` runs them (each round dispatched as the
    previous one is read back), then parked; seconds per token, from the first dispatch to the last read-back.

    *on_round* (instrumented passes) gets each round's wall time.
    """
    produced = 0
    started = round_started = time.perf_counter()
    solo.start_round(min(k, tokens))
    while True:
        produced += len(solo.finish_round())
        left = tokens - produced
        if on_round is not None:
            on_round(time.perf_counter() - round_started)
            round_started = time.perf_counter()
        if left < 2:
            return (time.perf_counter() - started) / produced
        solo.start_round(min(k, left))


class Stages:
    """Per-stage seconds of the rounds of an instrumented pass (full-width rounds only)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.current: dict[str, float] = {}
        self.rounds: list[dict[str, float]] = []
        self.width = 0

    def timed(self, stage: str, arrays: list[Any], started: float | None = None) -> None:
        """Evaluate *arrays* now; the time since *started* (default: now) goes to *stage*."""
        started = time.perf_counter() if started is None else started
        mx.eval(arrays)
        self.add(stage, time.perf_counter() - started)

    def add(self, stage: str, seconds: float) -> None:
        self.current[stage] = self.current.get(stage, 0.0) + seconds

    def round_done(self, seconds: float) -> None:
        if self.width == self.k:
            done = {stage: self.current.get(stage, 0.0) for stage in STAGES[:-1]}
            self.rounds.append({**done, "python": seconds - sum(done.values())})
        self.current = {}


class AttentionClock:
    """While :meth:`timing`, every attention call (mlxcel's rules included) is evaluated alone, its inputs
    first, and its seconds added up: the attention's share of a forward, the products' the rest."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        inner = mx.fast.scaled_dot_product_attention

        def timed(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            mx.eval(q, k, v)  # what comes before the attention (the cache's update included) is not its time
            started = time.perf_counter()
            out = inner(q, k, v, **kwargs)
            mx.eval(out)
            self.seconds += time.perf_counter() - started
            return out

        mx.fast.scaled_dot_product_attention = timed
        try:
            yield
        finally:
            mx.fast.scaled_dot_product_attention = inner


class TimedTarget:
    """The target adapter, its verify evaluated (and timed) as it is built, its attention apart, its
    rollback too."""

    def __init__(self, inner: Any, stages: Stages) -> None:
        self.inner, self.stages = inner, stages

    def __getattr__(self, name: str) -> Any:  # forward, as the adapter's own
        return getattr(self.inner, name)

    def verify(self, tokens: Any, cache: list[Any], split: Split) -> Any:
        clock = AttentionClock()
        started = time.perf_counter()
        with clock.timing():
            result = self.inner.verify(tokens, cache, split)
            mx.eval(result.logits)
        self.stages.width = tokens.shape[1]
        self.stages.add("attention", clock.seconds)
        self.stages.add("verify", time.perf_counter() - started - clock.seconds)
        return result

    def rollback(self, cache: list[Any], verify: Any, kept: int) -> None:
        started = time.perf_counter()
        self.inner.rollback(cache, verify, kept)
        self.stages.timed("rollback", [c.state for c in cache], started)


class TimedDrafter:
    """One sequence's drafter, its drafts (and the catch-up they include) evaluated and timed."""

    def __init__(self, inner: Any, stages: Stages) -> None:
        self.inner, self.stages = inner, stages

    def __getattr__(self, name: str) -> Any:  # ready, catch_up, settle, accept: the drafter's own
        return getattr(self.inner, name)

    def draft(self, count: int) -> Any:
        drafts = self.inner.draft(count)
        self.stages.timed("draft", [drafts])
        return drafts


class SyncTimedBurst(Burst):
    """A burst whose round, once dispatched, is waited for at once: the read-back's wait, timed."""

    stages: Stages

    def start_round(self, *args: Any, **kwargs: Any) -> Any:  # whatever the burst's own start_round takes
        pending = super().start_round(*args, **kwargs)
        self.stages.timed("sync", [pending.drafts, pending.last])
        return pending


def classic_attention(served: Served, start: Start, tokens: int) -> float:
    """Seconds of attention in one classic step, median over *tokens* steps of a copy of *start*."""
    solo, clock, per_step = copied(served, start), AttentionClock(), []
    for _ in range(tokens):
        before = clock.seconds
        with clock.timing():
            solo.classic_steps(1, False, lambda token: True)
        per_step.append(clock.seconds - before)
    return median(per_step)


def measure(served: Served, start: Start, k: int, split: Split, tokens: int, chunk: int) -> list[dict[str, Any]]:
    """One sequence on each side at one K, decoded *chunk* tokens at a time in turn (on a shared, noisy
    machine the sides are measured seconds apart, not minutes); per chunk, each side's seconds per token."""
    classic = copied(served, start)
    reference_cache = copy.deepcopy(start.decoder.cache)
    generator = mlx_lm.stream_generate(served.reference, served.tokenizer, list(start.decoder.pending),
                                       max_tokens=tokens + 1, prompt_cache=reference_cache)
    real = copied(served, start, lambda cache: Burst(served.target, served.head.new_sequence(cache), split, None))
    stages = Stages(k)

    def timed_burst(cache: list[Any]) -> Burst:
        burst = SyncTimedBurst(TimedTarget(served.target, stages),
                               TimedDrafter(served.head.new_sequence(cache), stages), split, None)
        burst.stages = stages
        return burst

    instrumented = copied(served, start, timed_burst)
    records = []
    for _ in range(tokens // chunk):
        records.append({"classic": classic_chunk(classic, chunk), "mlx_lm": mlx_lm_chunk(generator, chunk),
                        "mtp": burst_rounds(real, k, chunk)})
        burst_rounds(instrumented, k, chunk, on_round=stages.round_done)
    assert real.burst is not None
    stats = real.burst.stats
    records[0].update(proposed=stats.proposed, accepted=stats.accepted, rounds=stats.rounds, stages=stages.rounds,
                      step_attention=classic_attention(served, start, chunk))
    return records


def report(context: float, depth: int, k: int, split: Split, passes: list[list[dict[str, Any]]]) -> None:
    chunks = [record for records in passes for record in records]
    step = median([c["classic"] for c in chunks])
    proposed, accepted, rounds = (sum(p[0][n] for p in passes) for n in ("proposed", "accepted", "rounds"))
    per_round = 1 + accepted / rounds
    stage = {s: median([r[s] for p in passes for r in p[0]["stages"]]) for s in STAGES}
    ideal = per_round * step / (stage["attention"] + stage["verify"] + stage["draft"])
    speedup = median([c["classic"] / c["mtp"] for c in chunks])
    versus = median([c["mlx_lm"] / c["mtp"] for c in chunks])
    step_attention = median([p[0]["step_attention"] for p in passes])
    print(f"{context:>7} {depth:>6} {k:>2} {split:>5} {accepted / proposed:>6.2f} {per_round:>5.2f} "
          f"{1 / median([c['mtp'] for c in chunks]):>7.1f} {speedup:>6.2f} {ideal:>6.2f} {speedup / ideal:>6.0%} "
          f"{per_round:>5.2f} {speedup / per_round:>5.0%} {versus:>6.2f} {step_attention / step:>6.2f}  "
          + " ".join(f"{stage[s] / step:>6.2f}" for s in STAGES)
          + f"  {sum(stage.values()) / step:>5.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tokens", type=int, default=48, help="tokens a sequence decodes on each side, per pass")
    parser.add_argument("--chunk", type=int, default=12, help="tokens a side decodes before the next side's turn "
                        "(a multiple of every K, or rounds narrow at each chunk's end)")
    parser.add_argument("--contexts", type=float, nargs="+", default=[0.0, 0.001, 0.003],
                        help="target context scales (at 24 x 1024: acceptance ~1.0, ~0.9, ~0.35-0.7)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--depths", type=int, nargs="+", default=[0], help="tokens of context before the prompt")
    args = parser.parse_args()
    if args.chunk < 2 or args.tokens < args.chunk:
        parser.error("--chunk must be at least 2 and --tokens at least --chunk")
    print(f"BLAS: {BLAS}; {args.tokens} tokens a sequence in chunks of {args.chunk}, {args.passes} passes, medians")
    positions = context_window(max(args.depths) + args.tokens * (args.passes + 1), 4096)
    with mlx_thread():  # the engine's attention rules, as the worker's thread has them
        for context in args.contexts:
            path = mtp_model("aligned", context, args.layers, args.hidden, positions)
            size = (path / "model.safetensors").stat().st_size / 1e9
            print(f"\n{path.name} ({size:.2f} GB fp32): loading, probing", flush=True)
            served = load(path)
            splits = probe_splits(served, args.k, inspect_checkpoint(path).context_length)
            for depth in args.depths:
                measure_at(served, context, depth, splits, args)
            del served
            gc.collect()
            mx.clear_cache()


def measure_at(served: Served, context: float, depth: int, splits: dict[int, Split | None],
               args: argparse.Namespace) -> None:
    started = time.perf_counter()
    start = prefill(served, deep_prompt(served, depth), splits[min(args.k)] or "wide")
    print(f"  depth {depth}: {len(start.decoder.tokens_in_cache) + 1} prompt tokens prefilled in "
          f"{time.perf_counter() - started:.0f}s", flush=True)
    measure(served, start, min(args.k), splits[min(args.k)] or "wide", 2 * 4, 4)  # warm every path up once
    results: dict[int, list[list[dict[str, Any]]]] = {k: [] for k in args.k}
    for number in range(args.passes):
        for k in args.k:
            results[k].append(measure(served, start, k, splits[k] or "wide", args.tokens, args.chunk))
        print(f"  pass {number + 1} done", flush=True)
    chunks = [c for passes in results.values() for records in passes for c in records]
    step, reference = median([c["classic"] for c in chunks]), median([c["mlx_lm"] for c in chunks])
    print(f"context {context}, depth {depth}: classic {1 / step:.1f} tok/s = {step * 1000:.1f} ms/token (the step); "
          f"mlx-lm stream_generate {1 / reference:.1f} tok/s; mlxcel classic / mlx-lm "
          f"{median([c['mlx_lm'] / c['classic'] for c in chunks]):.2f}")
    vetoed = [k for k, split in splits.items() if split is None]
    if vetoed:
        print(f"the exactness probe vetoed K={sorted(vetoed)}: measured with the wide verify anyway (inexact)")
    print(f"{'context':>7} {'depth':>6} {'K':>2} {'split':>5} {'accept':>6} {'tok/r':>5} {'MTP t/s':>7} {'speed':>6} "
          f"{'ideal':>6} {'%ideal':>6} {'pure':>5} {'%pure':>5} {'/mlxlm':>6} {'attn/s':>6}  "
          + " ".join(f"{s[:6]:>6}" for s in STAGES) + f"  {'round':>5}")
    for k in args.k:
        report(context, depth, k, splits[k] or "wide", results[k])


if __name__ == "__main__":
    main()
