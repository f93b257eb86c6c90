"""Inkling's MTP head and speculative target, against transformers' ``MtpModel`` and the single-step chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.inkling_checkpoints import EXTENT, UNPADDED, WINDOW, build_mtp, build_target, load_reference

torch = pytest.importorskip("torch")

PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, UNPADDED, EXTENT + WINDOW)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    target = build_target(tmp_path_factory.mktemp("inkling-mtp") / "inkling-tiny", mtp_layers=1)
    return target, build_mtp(target)


def _load(target: Path) -> tuple[Any, Any, Any]:
    from mlxcel.models.drafters.loader import inspect_drafter, load_drafter
    from mlxcel.models.loader import inspect_checkpoint, load_checkpoint
    from mlxcel.models.speculative import speculative_target

    info = inspect_checkpoint(target)
    model, _ = load_checkpoint(info)
    spec = inspect_drafter(target, info.model_type, mtp=True, draft_model=None)
    assert (spec.family, spec.block_size, spec.name) == ("inkling_mtp", 3, f"{target.name}#mtp")
    return model, speculative_target(info.model_type, model), load_drafter(spec, target, model)


def _reference_drafts(hf: Any, mtp: Any, prompt: list[int], count: int) -> list[int]:
    """transformers: the target's last-layer (pre-norm) hidden states, then ``MtpLayer`` over the whole
    shifted sequence, recomputed per draft; logits through the target's final norm, mu-P divide and head."""
    text = hf.config.text_config
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1]
        tokens = [*prompt[1:], int(out.logits[0, -1].argmax())]
        drafts: list[int] = []
        for _ in range(count):
            length = hidden.shape[1]
            mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
            block = mtp.layers[0](mtp.embed_tokens(torch.tensor([tokens])), hidden, position_embeddings=None,
                                  attention_mask=mask, position_ids=torch.arange(length)[None], cache=None)
            normed = hf.model.language_model.norm(block[:, -1:]) / text.logits_mup_width_multiplier
            drafts.append(int(hf.lm_head(normed)[0, -1, :text.unpadded_vocab_size].argmax()))
            hidden, tokens = torch.cat([hidden, block[:, -1:]], dim=1), [*tokens, drafts[-1]]
    return drafts


def test_drafts_equal_transformers_mtp_reference(pair: tuple[Path, Any]) -> None:
    target_dir, mtp = pair
    model, target, drafter = _load(target_dir)
    hf = load_reference(target_dir)
    cache = model.make_cache()
    logits, hidden = target.forward(mx.array([PROMPT]), cache)
    bonus = mx.argmax(logits[:, -1:], axis=-1)
    sequence = drafter.new_sequence(cache)
    sequence.catch_up(hidden[:, :-1], mx.array([PROMPT[1:]]))
    sequence.catch_up(hidden[:, -1:], bonus)
    drafts = np.array(sequence.draft(3))[0].tolist()
    assert drafts == _reference_drafts(hf, mtp, PROMPT, 3)


def _live(cache: list[Any]) -> list[np.ndarray]:
    return [np.array(a) for c in cache for a in c.live_state()]


@pytest.mark.parametrize("split", ["wide", "half"])
def test_verify_then_rollback_leaves_the_states_single_steps_leave(pair: tuple[Path, Any], split: str) -> None:
    model, target, _ = _load(pair[0])
    block = [11, 22, 33, 44]
    for kept in (1, 2, 3, 4):
        stepped, verified = model.make_cache(), model.make_cache()
        for c in (stepped, verified):
            target.forward(mx.array([PROMPT]), c)
        for token in block[:kept]:
            step_logits, _ = target.forward(mx.array([[token]]), stepped)
        verify = target.verify(mx.array([block]), verified, split)
        target.rollback(verified, verify, kept)
        np.testing.assert_allclose(np.array(verify.logits[0, kept - 1]), np.array(step_logits[0, -1]), atol=1e-5)
        for a, b in zip(_live(verified), _live(stepped), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        # And the next step reads them alike.
        after = [np.array(target.forward(mx.array([[55]]), c)[0]) for c in (verified, stepped)]
        np.testing.assert_allclose(after[0], after[1], atol=1e-5)


def test_the_drafters_chained_steps_are_undone_at_accept(pair: tuple[Path, Any]) -> None:
    model, target, drafter = _load(pair[0])
    cache = model.make_cache()
    _, hidden = target.forward(mx.array([PROMPT]), cache)
    once, twice = drafter.new_sequence(cache), drafter.new_sequence(cache)
    for seq in (once, twice):
        seq.catch_up(hidden[:, :-1], mx.array([PROMPT[1:]]))
        seq.catch_up(hidden[:, -1:], mx.array([[7]]))
    twice.draft(3)
    twice.accept(hidden[:, -1:], mx.array([[9]]), drafted=3)  # as if nothing was accepted and 9 emitted
    once.settle()
    once.catch_up(hidden[:, -1:], mx.array([[9]]))
    np.testing.assert_array_equal(np.array(once.draft(2)), np.array(twice.draft(2)))
