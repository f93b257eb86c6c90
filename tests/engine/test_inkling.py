"""Inkling through mlxcel's own model file, against transformers' ``inkling`` on the same inputs.

The checkpoint is transformers' own ``InklingForConditionalGeneration`` saved with ``save_pretrained``
(mlxcel/families/inkling/tiny.py); mlxcel loads it as a server does (``inspect_checkpoint``/``load_checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.families.inkling.tiny import EXTENT, UNPADDED, WINDOW, build_target, load_reference

torch = pytest.importorskip("torch")

# Past the sliding window and the full layers' relative extent, so both cut-offs are crossed.
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, UNPADDED, EXTENT + WINDOW + 3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_target(tmp_path_factory.mktemp("inkling") / "inkling-tiny")


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> tuple[Any, Any]:
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint

    model, _ = load_checkpoint(inspect_checkpoint(checkpoint))
    return model, load_reference(checkpoint)


def test_prefill_and_step_by_step_logits_equal_transformers(loaded: tuple[Any, Any]) -> None:
    from transformers import DynamicCache

    model, hf = loaded
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
        cache, steps = DynamicCache(config=hf.config), []
        for token in PROMPT:
            steps.append(hf(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1].numpy())
    assert full.shape == (len(PROMPT), UNPADDED)  # the padded head rows are sliced off
    ours = np.array(model(mx.array([PROMPT]))[0])
    np.testing.assert_allclose(ours, full, rtol=0, atol=1e-5 * np.abs(full).max())
    own_cache = model.make_cache()
    ours_steps = np.stack([np.array(model(mx.array([[t]]), own_cache)[0, -1]) for t in PROMPT])
    np.testing.assert_allclose(ours_steps, np.stack(steps), rtol=0, atol=1e-5 * np.abs(full).max())
    # A chunked prefill (what the engine does for a long prompt) continues the same states.
    chunked = model.make_cache()
    model(mx.array([PROMPT[:11]]), chunked)
    tail = np.array(model(mx.array([PROMPT[11:]]), chunked)[0])
    np.testing.assert_allclose(tail, full[11:], rtol=0, atol=1e-5 * np.abs(full).max())


def test_greedy_text_equals_transformers_generate_for_32_tokens(loaded: tuple[Any, Any]) -> None:
    model, hf = loaded
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT[:9]]), max_new_tokens=32, do_sample=False,
                               eos_token_id=None)[0, 9:].tolist()
    cache, tokens = model.make_cache(), []
    logits = model(mx.array([PROMPT[:9]]), cache)
    for _ in range(32):
        tokens.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([tokens[-1:]]), cache)
    assert tokens == expected


def test_the_cache_reports_what_a_later_step_reads(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    cache = model.make_cache()
    model(mx.array([PROMPT[:5]]), cache)
    layer = cache[0]
    assert (layer.offset, layer.empty(), layer.is_trimmable()) == (5, False, False)
    live = layer.live_state()
    assert [a.shape[-2] for a in live[:2]] == [5, 5] and len(live) == 6  # keys, values, four conv states
    assert all(a.shape[1] == 3 for a in live[2:])  # kernel 4: the last three inputs
    assert not hasattr(layer, "merge")  # so the engine serves Inkling one sequence at a time


def test_attention_in_blocks_of_queries_is_the_same_attention(loaded: tuple[Any, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """At a long context a chunk's queries attend in blocks (bounded bias and scores); with a budget of a few
    rows, a prefill crosses block edges in every layer and still gives transformers' logits."""
    from mlxcel.families.inkling import model as inkling

    model, hf = loaded
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    heads = max(layer.self_attn.heads for layer in model.layers)
    monkeypatch.setattr(inkling, "SCORE_BUDGET", 3 * heads * len(PROMPT))  # 3 to 5 query rows a block
    ours = np.array(model(mx.array([PROMPT]))[0])
    np.testing.assert_allclose(ours, full, rtol=0, atol=1e-5 * np.abs(full).max())
