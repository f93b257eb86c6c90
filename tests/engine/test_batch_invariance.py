"""A row's decode step is the same bytes whatever batch it runs in: alone, or beside 1-4 other rows of other
lengths (so behind more or less left padding, in products of more or fewer rows). That is what keeps a
request's text at temperature 0 independent of who else is served, and equal with speculation on and off
under the same arrivals (rows finish at other steps; rollbacks turn rejected positions into padding).

Three causes, all mended on the MLX thread: attention over padded keys (``models/grouped_attention.py`` sums
keys in blocks counted from the newest), products whose kernel this BLAS picks by row count
(``models/row_exact.py`` multiplies those in chunks that give each row its one-row bytes), and an MoE's experts,
which mlx-lm multiplies broadcast under 64 (token, expert) pairs and sorted from 64 (``row_exact`` multiplies
every pair as the sorted path does; an MoE row beside 39 others: ``test_batch_exactness.py``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.attention import mlx_thread
from mlxcel.models.row_exact import measure_steps

OTHERS = ([], [5], [30, 2], [14, 60, 3], [1, 1, 45, 8])  # the other rows' prompt lengths, batch by batch


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # Hidden 512: OpenBLAS multiplies some of its shapes with another kernel from 2 rows, others from 4.
    model, _ = load(str(build_mtp_checkpoint(tmp_path_factory.mktemp("invariance") / "qwen35", layers=4,
                                             hidden=512)))
    split = measure_steps(model, 5)
    assert split is not None  # the CPU backend
    return model


def _prefilled(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _steps(model: Any) -> tuple[bytes, list[bytes]]:
    """Our row's next-token logits alone, and in each batch of :data:`OTHERS`, as bytes."""
    rng = np.random.default_rng(0)
    ours = rng.integers(3, 90, 9).tolist()
    alone = model(mx.array([[7]]), cache=_prefilled(model, ours))
    batched = []
    for others in OTHERS:
        caches = [_prefilled(model, ours)] + [_prefilled(model, rng.integers(3, 90, n).tolist()) for n in others]
        batch = [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]
        tokens = mx.array([[7]] + [[int(t)] for t in rng.integers(3, 90, len(others))])
        batched.append(np.array(model(tokens, cache=batch)[0, -1]).tobytes())
    return np.array(alone[0, -1]).tobytes(), batched


def test_a_rows_step_is_its_lone_step_at_any_width_and_padding(model: Any) -> None:
    with mlx_thread():
        alone, batched = _steps(model)
    assert batched == [alone] * len(OTHERS)


@pytest.mark.requires_openblas  # the kernels that part are OpenBLAS's; CI requires it
def test_off_the_mlx_thread_the_same_steps_part(model: Any) -> None:
    # What the rules mend, shown: mlx's own attention and whole products (another thread: mlx-lm as it ships).
    alone, batched = _steps(model)
    assert batched[0] == alone  # alone in a batch of one, no padding: the same computation
    assert any(step != alone for step in batched[1:])
