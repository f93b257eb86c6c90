"""Gemma 4 and its assistant through mlxcel, against transformers' reference on the same inputs.

The checkpoints are transformers' own classes saved with ``save_pretrained`` (mlxcel/families/gemma4/tiny.py);
mlxcel loads them as a server does (``inspect_checkpoint``/``load_checkpoint``, ``load_drafter``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.families.gemma4.tiny import PERMUTATION, WINDOW, build_assistant, build_target
from tests.engine import reference_blas

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")  # the probe's rows verify runs on it

torch = pytest.importorskip("torch")

# Prompt lengths: inside the sliding window, at its edge, past it, and past the ring's slack.
LENGTHS = (5, WINDOW - 1, WINDOW + 1, WINDOW + 2, 40, 100)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    target = build_target(root / "gemma4-tiny", wrapper=True)
    permutation = build_target(root / "gemma4-permutation", kind="permutation")
    return {"target": target, "assistant": build_assistant(root / "gemma4-tiny-assistant", target),
            "permutation": permutation,
            "agreeing": build_assistant(root / "gemma4-agreeing-assistant", permutation, kind="agreeing"),
            "centroids": build_assistant(root / "gemma4-centroid-assistant", target, kind="centroids"),
            "unified": build_assistant(root / "gemma4-unified-assistant", target, kind="unified")}


def _load(target: Path, assistant: Path) -> tuple[Any, Any, Any]:
    from mlxcel.checkpoints import (
        inspect_checkpoint,
        inspect_drafter,
        load_checkpoint,
        load_drafter,
        speculative_target,
    )

    info = inspect_checkpoint(target)
    model, _ = load_checkpoint(info)
    spec = inspect_drafter(info, mtp=False, draft_model=assistant)
    return model, speculative_target(info.model_type, model), load_drafter(spec, info, model)


def _reference(target: Path, assistant: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration

    config = (target / "config.json").read_text()
    cls = Gemma4ForConditionalGeneration if '"model_type": "gemma4"' in config else AutoModelForCausalLM
    return cls.from_pretrained(target).eval(), AutoModelForCausalLM.from_pretrained(assistant).eval()


def _reference_drafts(hf: Any, assistant: Any, prompt: list[int], token: int, count: int) -> list[int]:
    """transformers' single-position drafting loop (``SinglePositionMultiTokenCandidateGenerator``)."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        hidden = out.hidden_states[-1][:, -1:]
        embed = hf.get_input_embeddings()
        current, drafts = torch.tensor([[token]]), []
        for _ in range(count):
            step = assistant(inputs_embeds=torch.cat([embed(current), hidden], dim=-1),
                             attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long),
                             position_ids=torch.tensor([[len(prompt)]]), shared_kv_states=out.shared_kv_states)
            current, hidden = step.logits.argmax(-1), step.last_hidden_state
            drafts.append(int(current))
    return drafts


@pytest.mark.slow
def test_target_logits_equal_transformers_for_a_prefill_and_step_by_step_past_the_window(
        pairs: dict[str, Path]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model, target, _ = _load(pairs["target"], pairs["assistant"])
    hf, _ = _reference(pairs["target"], pairs["assistant"])
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 512, 3 * WINDOW + 70)]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    prefill = np.array(target.forward(mx.array([tokens]), make_prompt_cache(model))[0][0])
    cache = make_prompt_cache(model)
    steps = np.stack([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in tokens])
    scale = np.abs(expected).max()
    assert scale > 1.0  # peaky enough that a wrong model could not pass at this tolerance
    np.testing.assert_allclose(prefill, expected, atol=1e-4 * scale)
    np.testing.assert_allclose(steps, expected, atol=1e-4 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("pair", [("target", "assistant"), ("permutation", "agreeing"), ("target", "centroids"),
                                  ("target", "unified")])
def test_drafts_equal_transformers_greedy_drafts(pairs: dict[str, Path], pair: tuple[str, str]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model, target, drafter = _load(pairs[pair[0]], pairs[pair[1]])
    hf, assistant = _reference(pairs[pair[0]], pairs[pair[1]])
    for length in LENGTHS:
        tokens = [int(t) for t in np.random.default_rng(length).integers(3, 512, length + 1)]
        prompt, token = tokens[:-1], tokens[-1]
        cache = make_prompt_cache(model)
        _, hidden = target.forward(mx.array([prompt]), cache)
        sequence = drafter.new_sequence(cache)
        sequence.catch_up(hidden, mx.array([[*prompt[1:], token]]))
        assert sequence.draft(3)[0].tolist() == _reference_drafts(hf, assistant, prompt, token, 3), length


@pytest.mark.slow
def test_the_agreeing_pairing_agrees_inside_transformers(pairs: dict[str, Path]) -> None:
    """The constructed pairing does what its builder claims, checked in the reference first."""
    hf, assistant = _reference(pairs["permutation"], pairs["agreeing"])
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 512, 30)]
    with torch.no_grad():
        following = hf(torch.tensor([prompt])).logits[0].argmax(-1).numpy()
    assert (following == PERMUTATION[prompt]).all()  # the next token is the permutation of the current one
    token = int(PERMUTATION[prompt[-1]])
    chain = [int(PERMUTATION[token])]
    for _ in range(2):
        chain.append(int(PERMUTATION[chain[-1]]))
    assert _reference_drafts(hf, assistant, prompt, token, 3) == chain  # the token after next, every step


@pytest.mark.slow
def test_verify_and_rollback_are_the_single_step_chain_around_the_window_and_the_ring(
        pairs: dict[str, Path]) -> None:
    """Every width to K and every rollback prefix, at offsets where the block crosses the sliding
    window and where it crosses the ring's end: byte for byte the single-token chain. Without the
    slack (mlx-lm's own rotating cache of exactly the window), the same probe fails. The row split is the
    one: a wide verify's block of queries attends at once, through mlx's kernel, not as a step's lone query.

    Under mlx's reference BLAS, in a process of its own (tests/engine/reference_blas.py): this machine's
    OpenBLAS multiplies 2-row blocks of these shapes with another kernel than one row, so under it
    no verify of these models is exact, whatever the cache does.
    """
    reference_blas.run("gemma4_probe", str(pairs["target"]), str(pairs["assistant"]), str(WINDOW))


def test_a_stop_during_the_exactness_probe_abandons_it_instead_of_vetoing(pairs: dict[str, Path]) -> None:
    """A server stopped while it probes a big model stops between the probe's steps; the stop is not
    mistaken for a probe that could not run (which would veto and serve on)."""
    from mlxcel.checkpoints import inspect_checkpoint, inspect_drafter, load_checkpoint
    from mlxcel.engine.messages import LoadCancelled
    from mlxcel.engine.speculation import set_up

    info = inspect_checkpoint(pairs["target"])
    model, _ = load_checkpoint(info)
    spec = inspect_drafter(info, mtp=False, draft_model=pairs["assistant"])
    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:  # the probe has built its first starting state
            raise LoadCancelled("stopped while loading the model")

    with pytest.raises(LoadCancelled):
        set_up(spec, info, model, mx.default_stream(mx.default_device()), "cpu", 3, 512, False, check=check)
    assert len(calls) == 2  # nothing ran after the stop
