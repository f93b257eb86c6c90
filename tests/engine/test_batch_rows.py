"""Rows that join the batch in one step are merged in with one copy of its caches, and rows that leave cost one
copy: what each row then reads is what mlx-lm's ``extend``, one batch at a time, and ``filter`` leave."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from mlxcel.engine.batch import ContinuousBatch
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models import batch_rows
from tests.engine.test_batch_rollback import _batch, _row_caches

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7], [5, 5], [9, 8, 7, 6, 5, 4],
           [4, 4, 2], [8, 1, 9, 2, 7, 3, 6], [6, 2, 8]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen 3.5: attention layers (``BatchKVCache``) and gated-delta ones (``ArraysCache``) in one cache."""
    model, _ = load(str(build_mtp_checkpoint(tmp_path_factory.mktemp("join") / "qwen35", context_scale=1.0)))
    return model


def _part(model: Any, prompts: list[list[int]], decoded: int = 0) -> list[Any]:
    """A batch's cache of *prompts* (each prefilled alone, merged as mlx-lm merges them), then *decoded* steps
    of one token a row: its rows at their own lengths, left-padded."""
    merged = _batch(_row_caches(model, prompts))
    for step in range(decoded):
        model(mx.array([[7 + step]] * len(prompts)), cache=merged)
    mx.eval([layer.state for layer in merged])
    return merged


def _rows(cache: list[Any]) -> list[list[bytes]]:
    """What each row of *cache* holds that any step reads: its keys and values past its padding, at the batch's
    index, its offset; its recurrent arrays."""
    rows: list[list[bytes]] = []
    for layer in cache:
        if isinstance(layer, BatchKVCache):
            for i in range(layer.offset.shape[0]):
                single = layer.extract(i)
                pad = int(layer.left_padding[i].item())
                assert pad + single.offset == layer._idx
                arrays = [single.keys, single.values, layer.offset[i:i + 1]]
                if i >= len(rows):
                    rows.append([])
                rows[i] += [np.array(a).tobytes() for a in arrays]
        else:
            assert isinstance(layer, ArraysCache)
            for i in range(layer.batch_size):
                if i >= len(rows):
                    rows.append([])
                rows[i] += [np.array(a[i]).tobytes() if a is not None else b"" for a in layer.cache]
    return rows


@pytest.mark.parametrize("shape", [[1, 1, 1], [2, 1, 3], [3, 2]], ids=["one-row-each", "mixed", "batch-and-pair"])
def test_rows_joined_at_once_hold_what_one_join_at_a_time_leaves(model: Any, shape: list[int]) -> None:
    prompts = iter(PROMPTS * 2)
    groups = [[next(prompts) for _ in range(rows)] for rows in shape]
    # The first part decodes some steps (a batch running), the others are fresh prompts of their own lengths.
    parts = [_part(model, group, decoded=3 if i == 0 else 0) for i, group in enumerate(groups)]
    again = [_part(model, group, decoded=3 if i == 0 else 0) for i, group in enumerate(groups)]
    for layers in zip(*again, strict=True):  # mlx-lm's own extend, one part at a time: the reference
        for layer in layers[1:]:
            layers[0].extend(layer)
    joined = [batch_rows.join_layers(layers) for layers in zip(*parts, strict=True)]
    assert _rows(joined) == _rows(again[0])
    assert [int(layer._idx) for layer in joined if isinstance(layer, BatchKVCache)] == \
        [int(layer._idx) for layer in again[0] if isinstance(layer, BatchKVCache)]
    # And the next step reads them alike: the same logits, byte for byte.
    width = sum(shape)
    step = mx.array([[11]] * width)
    assert np.array(model(step, cache=joined)).tobytes() == np.array(model(step, cache=again[0])).tobytes()


def _calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """The second argument of each call of ``batch_rows.<name>`` from now on (the function still does its
    work)."""
    calls: list[Any] = []
    real = getattr(batch_rows, name)

    def counted(batch: Any, argument: Any) -> None:
        calls.append(list(argument))
        real(batch, argument)

    monkeypatch.setattr(batch_rows, name, counted)
    return calls


def _served(model: Any) -> list[list[tuple[int, bytes]]]:
    """Two rows decoding, then six prompts arriving at once (a prompt takes two passes, a chunk and its first
    step, and a step as many passes as prompts wait: three join in one step): each row's tokens and
    log-probabilities' bytes."""
    batch: ContinuousBatch[int] = ContinuousBatch(model, frozenset(), 8, 512, mx.default_stream(mx.default_device()))
    out: list[list[tuple[int, bytes]]] = [[] for _ in PROMPTS]
    for i in range(2):
        batch.insert(i, PROMPTS[i], None, [], 8, None, [])
    for step in range(40):
        if step == 4:
            for i in range(2, len(PROMPTS)):
                batch.insert(i, PROMPTS[i], None, [], 8, None, [])
        for i, response in batch.step().tokens:
            out[i].append((response.token, np.array(response.logprobs).tobytes()))
    batch.close()
    return out


def test_a_batch_that_prompts_join_together_writes_what_it_wrote_joined_one_at_a_time(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    joins = _calls(monkeypatch, "join_rows")
    together = _served(model)
    assert max(len(joined) for joined in joins) >= 2  # several rows did join in one step

    def one_at_a_time(batch: Any, joined: list[Any]) -> None:  # what the batch did before: mlx-lm's extend
        for part in joined:
            batch.extend(part)

    monkeypatch.setattr(batch_rows, "join_rows", one_at_a_time)
    assert together == _served(model)
    assert all(len(tokens) == 8 for tokens in together)


@pytest.mark.parametrize("keep", [[1, 2, 3], [0, 2], [3], [2, 0, 1]], ids=["first-left", "two-left", "one-kept",
                                                                         "reordered"])
def test_rows_left_hold_what_mlx_lms_filter_leaves(model: Any, keep: list[int]) -> None:
    # Row 0 is the longest prompt (no padding): once it leaves, every kept row shares some padding, which both
    # cut (mlx-lm's after its gather, ours before it).
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[4], PROMPTS[1]]
    ours, theirs = _part(model, prompts, decoded=2), _part(model, prompts, decoded=2)
    for layer in ours:
        batch_rows.filter_layer(layer, keep)
    for layer in theirs:
        layer.filter(keep)
    assert _rows(ours) == _rows(theirs)
    assert [(layer._idx, layer.keys.shape) for layer in ours if isinstance(layer, BatchKVCache)] == \
        [(layer._idx, layer.keys.shape) for layer in theirs if isinstance(layer, BatchKVCache)]
    step = mx.array([[11]] * len(keep))
    for _ in range(2):  # the next steps write into the caches and read them alike
        assert np.array(model(step, cache=ours)).tobytes() == np.array(model(step, cache=theirs)).tobytes()


def _leaving(model: Any) -> list[list[tuple[int, bytes]]]:
    """Five rows of their own lengths that leave one or two at a time (their own max_tokens), then two more
    prompts: each row's tokens and log-probabilities' bytes."""
    batch: ContinuousBatch[int] = ContinuousBatch(model, frozenset(), 8, 512, mx.default_stream(mx.default_device()))
    lengths = [3, 9, 5, 12, 3, 7, 6]
    out: list[list[tuple[int, bytes]]] = [[] for _ in lengths]
    for i in range(5):
        batch.insert(i, PROMPTS[i], None, [], lengths[i], None, [])
    for step in range(40):
        if step == 6:
            for i in range(5, 7):
                batch.insert(i, PROMPTS[i], None, [], lengths[i], None, [])
        for i, response in batch.step().tokens:
            out[i].append((response.token, np.array(response.logprobs).tobytes()))
    batch.close()
    assert [len(tokens) for tokens in out] == lengths
    return out


def test_a_batch_whose_rows_leave_writes_what_it_wrote_with_mlx_lms_filter(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    filtered = _calls(monkeypatch, "filter_rows")
    ours = _leaving(model)
    assert len(filtered) >= 3  # rows did leave, at several steps

    def theirs(batch: Any, keep: list[int]) -> None:  # what the batch did before: mlx-lm's own filter
        type(batch).filter(batch, keep)

    monkeypatch.setattr(batch_rows, "filter_rows", theirs)
    assert ours == _leaving(model)
