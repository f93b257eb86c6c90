"""A batch's verify is byte for byte its classic steps: the ``rows`` split with the products measured for
every batch width multiplies a (B, K) block in chunks that give each row and position its one-row bytes, as
the batch's classic step multiplies its B rows (``models/row_exact.py``), and attends a query at a time.

At hidden 512 on OpenBLAS, a (B, K) block multiplied whole differs from its K classic steps at every B >= 2
in hundreds of logit bytes a position, whatever the split measured for one row; measured for the batch, none.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.families.glm4_moe_lite.target import Glm4MoeLiteTarget
from mlxcel.families.glm4_moe_lite.tiny import build_glm_checkpoint
from mlxcel.families.qwen3_5.target import Qwen35Target
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.row_exact import measure

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")
WIDTH = 4


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("batch-exact") / "qwen35", layers=4, hidden=512)
    model, _ = load(str(path))
    return model


def _batch(model: Any, rows: int, rng: np.random.Generator, lengths: tuple[int, ...] = ()) -> list[Any]:
    """*rows* prompts of different lengths (*lengths*, else 5, 8, ...), each prefilled alone, merged as
    mlx-lm's batch holds them."""
    caches = []
    for row in range(rows):
        cache = make_prompt_cache(model)
        size = lengths[row % len(lengths)] if lengths else 5 + 3 * row
        model(mx.array([rng.integers(3, 90, size=size).tolist()]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]


@pytest.fixture(scope="module")
def glm_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint

    model, _ = load_checkpoint(inspect_checkpoint(build_glm_checkpoint(tmp_path_factory.mktemp("batch-exact") / "glm")))
    return model  # as the server loads it: the family's prepare() gives its router gates linear layers


@pytest.fixture(scope="module")
def gemma_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint
    from mlxcel.families.gemma4.tiny import build_target

    model, _ = load_checkpoint(inspect_checkpoint(build_target(tmp_path_factory.mktemp("batch-exact") / "gemma4")))
    return model


def _check(model: Any, target: Any, rows: int, lengths: tuple[int, ...] = ()) -> None:
    split = measure(model, WIDTH, max_batch=max(4, rows))
    assert split.max_batch >= max(4, rows)
    rng = np.random.default_rng(rows)
    base = _batch(model, rows, rng, lengths)
    block = mx.array(rng.integers(0, 200, size=(rows, WIDTH)).tolist())
    chain, steps = copy.deepcopy(base), []
    for position in range(WIDTH):  # the batch's classic steps: one token a row, every row at once
        logits, _ = target.forward(block[:, position:position + 1], chain)
        mx.eval(logits)
        steps.append(np.array(logits[:, 0]).view(np.uint8))
    verify = target.verify(block, copy.deepcopy(base), "rows")
    mx.eval(verify.logits)
    differing = [int((np.array(verify.logits[:, p]).view(np.uint8) != steps[p]).sum()) for p in range(WIDTH)]
    assert differing == [0] * WIDTH


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_a_batch_verify_is_byte_for_byte_its_classic_steps(wide_model: Any, rows: int) -> None:
    _check(wide_model, Qwen35Target(wide_model), rows)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_a_latent_attention_batch_verify_is_byte_for_byte_its_classic_steps(glm_model: Any, rows: int) -> None:
    # GLM-4.7-Flash's verify attends a query row at a time with each row's left padding masked, as its step does.
    # At 8 rows its 64 (token, expert) pairs a layer are sorted by expert, where the steps' 16 are broadcast.
    _check(glm_model, Glm4MoeLiteTarget(glm_model), rows)


def test_an_moe_rows_step_is_its_lone_step_beside_many_rows(glm_model: Any) -> None:
    """The tiny GLM's experts (32 x 64, top 2) beside 39 rows: 80 pairs, sorted by expert; alone, 2 pairs,
    broadcast. On this OpenBLAS the two rounded otherwise before ``row_exact`` made every pair flat."""
    measure(glm_model, 1, max_batch=40)  # steps of up to 40 rows
    alone = glm_model(mx.array([[7]]), cache=_batch(glm_model, 1, np.random.default_rng(1), (9,)))
    rng = np.random.default_rng(1)  # our row's prompt again, then 39 others
    wide = _batch(glm_model, 40, rng, (9,))
    tokens = mx.array([[7]] + [[int(t)] for t in rng.integers(3, 90, 39)])
    assert np.array(glm_model(tokens, cache=wide)[0, -1]).tobytes() == np.array(alone[0, -1]).tobytes()


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_a_sliding_window_batch_verify_is_byte_for_byte_its_classic_steps(gemma_model: Any, rows: int) -> None:
    # Gemma 4: rows inside the window, past it, and past the ring of window + slack.
    from mlxcel.families.gemma4.target import Gemma4Target

    _check(gemma_model, Gemma4Target(gemma_model), rows, lengths=(5, 30, 120, 9))


def test_the_probe_finds_every_width_exact_under_the_measured_split_and_declines_a_width_that_is_not(
        wide_model: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.exactness import probe_batch_widths

    target = Qwen35Target(wide_model)
    measure(wide_model, WIDTH, max_batch=4)
    fresh = make_prompt_cache(wide_model)
    checked: list[int] = []  # the progress it reports: each width as it is done
    assert probe_batch_widths(target, wide_model, fresh, WIDTH, range(2, 5), "rows", 200, checked=checked.append) == {}
    assert checked == [2, 3, 4]

    class OffByOneUlp:  # a verify whose last position's logits are not the classic step's: what the probe is for
        def __init__(self, inner: Qwen35Target) -> None:
            self.inner = inner

        def forward(self, tokens: Any, cache: list[Any]) -> Any:
            return self.inner.forward(tokens, cache)

        def verify(self, tokens: Any, cache: list[Any], split: Any) -> Any:
            verify = self.inner.verify(tokens, cache, split)
            nudged = verify.logits.at[:, -1, 0].add(mx.array(1e-3, dtype=verify.logits.dtype))
            return type(verify)(nudged, verify.hidden, verify.width, verify.states)

    declined = probe_batch_widths(OffByOneUlp(target), wide_model, fresh, WIDTH, range(2, 4), "rows", 200)  # type: ignore[arg-type]
    assert sorted(declined) == [2, 3] and all(f"at position {WIDTH - 1}" in d for d in declined.values()), declined
