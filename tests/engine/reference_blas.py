"""Checks that need mlx's reference BLAS, each run in a process of its own.

The BLAS is chosen once per process (``MLXCEL_BLAS=off`` here; the test process runs OpenBLAS where it
has it). Under the reference BLAS every product of the tiny Gemma 4 and Inkling models is exact at any row
count, so a ``rows`` verify (its attention a query at a time, as each step's) and its rollback can be held
to the single-token chain byte for byte without a measured product split; this machine's OpenBLAS
multiplies 2-row blocks of their shapes with another kernel than one row.

A test calls :func:`run`, which starts ``python -m tests.engine.reference_blas CHECK ARG...`` and fails
with the child's traceback when one of the check's assertions does. A bare interpreter rather than
pytest again: no collection, no torch (these checks compare mlxcel with itself, one token at a time),
and the test's checkpoints are passed in rather than built again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run(check: str, *args: str) -> None:
    """Run the check named *check* under the reference BLAS; an AssertionError with its stderr if it fails."""
    from mlxcel.testing.serving import child_env

    done = subprocess.run([sys.executable, "-m", "tests.engine.reference_blas", check, *args], cwd=ROOT,
                          env=child_env({"MLXCEL_BLAS": "off"}), capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def _target(directory: Path, assistant: Path | None = None) -> tuple[Any, Any]:
    """The model and its speculative target, loaded as a server loads them (with *assistant*, its
    drafter too: the same load the tests' in-process checks make)."""
    from mlxcel.checkpoints import (
        inspect_checkpoint,
        inspect_drafter,
        load_checkpoint,
        load_drafter,
        speculative_target,
    )

    info = inspect_checkpoint(directory)
    model, _ = load_checkpoint(info)
    target = speculative_target(info.model_type, model)
    load_drafter(inspect_drafter(info, mtp=assistant is None, draft_model=assistant), info, model)
    return model, target


def gemma4_probe(target_dir: str, assistant_dir: str, window: str) -> None:
    """Every width to K and every rollback prefix, where a block crosses the sliding window and where it
    crosses the ring's end: the row-split verify is exact (a wide verify's block of queries attends at once,
    through mlx's kernel, not as a step's lone query does). Without the slack (mlx-lm's own rotating cache of
    exactly the window), the same probe finds every split inexact."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from mlxcel.engine import exactness
    from mlxcel.families.gemma4.target import SLACK

    model, target = _target(Path(target_dir), Path(assistant_dir))
    width = int(window)
    exactness.OFFSETS = (width - 2, width + SLACK - 2, 300)
    # The deep case (what batched attention does over many keys) is tests/engine/test_rollback.py's
    # subject; here it only needs to lie past the other offsets, and a ring cache is prefilled for real,
    # which under the reference BLAS costs ~3 s at the default depth.
    exactness.DEEP_OFFSET = 1024
    for block in (2, 3, 4):
        result = exactness.probe_exactness(target, model, lambda: make_prompt_cache(model), block, 512, 4096)
        assert (result.split, result.detail) == ("rows", None), block

    def stock() -> list[Any]:
        return [KVCache() if i % 2 else RotatingKVCache(max_size=width) for i in range(4)]

    vetoed = exactness.probe_exactness(target, model, stock, 2, 512, 4096)
    assert vetoed.split is None and vetoed.detail is not None and "differs from the single-token chain" in vetoed.detail


def inkling_verify_and_rollback(target_dir: str, setting: str) -> None:
    """The row split, every rollback prefix of a 4-wide block after the *setting*'s prompt: the logits, every
    cache's state and the next step's logits are the single-token chain's bytes; and the probe (every
    width to K, every rollback prefix, at its offsets and the family's own) finds the row split exact at
    K = 2, 3, 4. *setting*: JSON of the prompt, the unpadded vocabulary and the family's probe offsets."""
    import mlx.core as mx
    import numpy as np

    from mlxcel.engine import exactness

    model, target = _target(Path(target_dir))
    given = json.loads(setting)
    tokens, vocab = given["prompt"], given["vocab"]
    assert target.probe_offsets == tuple(given["probe_offsets"])

    def live(cache: list[Any]) -> list[tuple[tuple[int, ...], bytes]]:
        return [(tuple(a.shape), np.array(a).tobytes()) for c in cache for a in c.live_state()]

    block = [11, 22, 33, 44]
    for split in ("rows",):
        for kept in (1, 2, 3, 4):
            stepped, verified = model.make_cache(), model.make_cache()
            for c in (stepped, verified):
                target.forward(mx.array([tokens]), c)
            for token in block[:kept]:
                step_logits, _ = target.forward(mx.array([[token]]), stepped)
            verify = target.verify(mx.array([block]), verified, split)
            target.rollback(verified, verify, kept)
            assert np.array(verify.logits[0, kept - 1]).tobytes() == np.array(step_logits[0, -1]).tobytes()
            assert live(verified) == live(stepped), (split, kept)
            after = [np.array(target.forward(mx.array([[55]]), c)[0]) for c in (verified, stepped)]
            assert after[0].tobytes() == after[1].tobytes(), (split, kept)  # and the next step reads them alike
    exactness.OFFSETS = (12, 300)
    # The deep case is tests/engine/test_rollback.py's subject; here it only needs to lie past the other
    # offsets (this family's cache is prefilled for real: seconds at the default depth on this BLAS).
    exactness.DEEP_OFFSET = 1024
    for k in (2, 3, 4):
        result = exactness.probe_exactness(target, model, model.make_cache, k, vocab, 4096)
        assert (result.split, result.detail) == ("rows", None), k


CHECKS: dict[str, Callable[..., None]] = {"gemma4_probe": gemma4_probe,
                                          "inkling_verify_and_rollback": inkling_verify_and_rollback}

if __name__ == "__main__":
    from mlxcel.blas import blas_kind, load_fast_blas

    load_fast_blas()  # MLXCEL_BLAS=off: mlx's own, before anything imports mlx
    assert blas_kind() == "reference", blas_kind()
    from mlxcel.models.attention import mlx_thread

    with mlx_thread():  # as the engine's worker: the probe's rows verify asserts it
        CHECKS[sys.argv[1]](*sys.argv[2:])
