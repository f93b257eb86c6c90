"""Inkling's MTP head and speculative target, against transformers' ``MtpModel`` and the single-step chain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.families.inkling.tiny import (
    EXTENT,
    PERMUTATION,
    UNPADDED,
    WINDOW,
    build_mtp,
    build_target,
    load_reference,
)
from tests.engine import reference_blas

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")  # the probe's rows verify runs on it

torch = pytest.importorskip("torch")

PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, UNPADDED, EXTENT + WINDOW)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Per head kind, a target directory holding that head's mtp.safetensors, and the head's reference."""
    root = tmp_path_factory.mktemp("inkling-mtp")
    random = build_target(root / "inkling-tiny", mtp_layers=1)
    permutation = build_target(root / "inkling-permutation", kind="permutation", mtp_layers=1)
    return {"random": (random, build_mtp(random)), "agreeing": (permutation, build_mtp(permutation, kind="agreeing"))}


@pytest.fixture(scope="module")
def pair(pairs: dict[str, tuple[Path, Any]]) -> tuple[Path, Any]:
    return pairs["random"]


def _load(target: Path) -> tuple[Any, Any, Any]:
    from mlxcel.checkpoints import (
        inspect_checkpoint,
        inspect_drafter,
        load_checkpoint,
        load_drafter,
        speculative_target,
    )

    info = inspect_checkpoint(target)
    model, _ = load_checkpoint(info)
    spec = inspect_drafter(info, mtp=True, draft_model=None)
    assert (spec.model_type, spec.block_size, spec.name) == (info.model_type, 3, f"{target.name}#mtp")
    return model, speculative_target(info.model_type, model), load_drafter(spec, info, model)


def _reference_drafts(hf: Any, mtp: Any, prompt: list[int], count: int) -> list[int]:
    """transformers' modules composed as the issue and upstream do: the target's PRE-final-norm hidden
    states (the final norm's input; ``hidden_states[-1]``, which transformers' own ``MTPCandidateGenerator``
    feeds, is its output), then ``MtpLayer`` over the whole shifted sequence, recomputed per draft;
    logits through the target's final norm, mu-P divide and head (``MtpModel._project_to_logits``
    applies no norm: docs/mtp.md)."""
    text = hf.config.text_config
    norm = hf.model.language_model.norm
    captured: list[Any] = []
    hook = norm.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    with torch.no_grad():
        try:
            out = hf(input_ids=torch.tensor([prompt]), use_cache=False)
        finally:
            hook.remove()
        hidden = captured[0]
        tokens = [*prompt[1:], int(out.logits[0, -1].argmax())]
        drafts: list[int] = []
        for _ in range(count):
            length = hidden.shape[1]
            mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
            block = mtp.layers[0](mtp.embed_tokens(torch.tensor([tokens])), hidden, position_embeddings=None,
                                  attention_mask=mask, position_ids=torch.arange(length)[None], cache=None)
            normed = norm(block[:, -1:]) / text.logits_mup_width_multiplier
            drafts.append(int(hf.lm_head(normed)[0, -1, :text.unpadded_vocab_size].argmax()))
            hidden, tokens = torch.cat([hidden, block[:, -1:]], dim=1), [*tokens, drafts[-1]]
    return drafts


@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_drafts_equal_transformers_mtp_reference(pairs: dict[str, tuple[Path, Any]], kind: str) -> None:
    target_dir, mtp = pairs[kind]
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


def test_the_agreeing_pairing_agrees_inside_transformers(pairs: dict[str, tuple[Path, Any]]) -> None:
    """The constructed pairing does what its builder claims, checked in the reference first: the
    target's next token is the permutation of the current one, and the head drafts the token after
    next at every chained step."""
    target_dir, mtp = pairs["agreeing"]
    hf = load_reference(target_dir)
    with torch.no_grad():
        following = hf(input_ids=torch.tensor([PROMPT])).logits[0].argmax(-1).numpy()
    assert (following == PERMUTATION[PROMPT]).all()
    chain = [int(PERMUTATION[PERMUTATION[PROMPT[-1]]])]  # after the bonus token PERMUTATION[last]
    for _ in range(3):
        chain.append(int(PERMUTATION[chain[-1]]))
    assert _reference_drafts(hf, mtp, PROMPT, 4) == chain


@pytest.mark.slow
def test_verify_then_rollback_leaves_the_states_single_steps_leave_byte_for_byte(pair: tuple[Path, Any]) -> None:
    """The row split, every rollback prefix of a 4-wide block past the window and the relative extent:
    the logits, every cache's keys/values and convolution states, and the next step's logits are the
    single-token chain's bytes. And the exactness probe (every width to K, every rollback prefix, at
    its offsets and where a block crosses the window and the extent) finds the row split exact at
    K = 2, 3, 4.

    Under mlx's reference BLAS, in a process of its own (tests/engine/reference_blas.py), where every
    product is exact at any row count; OpenBLAS's are pinned by the next test.
    """
    reference_blas.run("inkling_verify_and_rollback", str(pair[0]), json.dumps(
        {"prompt": PROMPT, "vocab": UNPADDED, "probe_offsets": [WINDOW - 2, EXTENT - 2]}))


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


@pytest.mark.requires_openblas  # OpenBLAS's kernels are what makes a wide verify inexact; CI requires it
def test_under_openblas_the_probe_finds_an_exact_split_at_every_k(pair: tuple[Path, Any]) -> None:
    """OpenBLAS multiplies a block of rows of some of these shapes with another kernel than one row
    (which shapes, and from how many rows, depends on the CPU: Zen 3's kernels differ from AVX-512
    machines'), so a wide verify is inexact somewhere; the row split, with this family's attention over
    each query's own keys and its router a row at a time, is exact on both. Checked here against the
    single-token chain at a 1,024-token prompt, outside the probe. The prompt is prefilled for real once;
    the chain and each K's verify start from copies of that state (as the probe's own cases do), and the
    chain's first K steps are the steps a K-wide verify is checked against."""
    import copy

    from mlxcel.engine import exactness

    model, target, _ = _load(pair[0])
    rng = np.random.default_rng(7)
    prompt, block = rng.integers(3, UNPADDED, 1024).tolist(), rng.integers(3, UNPADDED, 4).tolist()
    prefilled = model.make_cache()
    target.forward(mx.array([prompt]), prefilled)
    mx.eval([a for c in prefilled for a in c.live_state()])
    splits = {}
    for k in (2, 3, 4):
        found = exactness.probe_exactness(target, model, model.make_cache, k, UNPADDED, 4096)
        assert found.split is not None and found.detail is None, (k, found.detail)
        splits[k] = found.split
    # The chain after the probes: their row split may lay a lone step's rows in tiles (a server measures it
    # before its first step).
    chain = copy.deepcopy(prefilled)
    steps = [np.array(target.forward(mx.array([[token]]), chain)[0][0, -1]).tobytes() for token in block]
    for k, split in splits.items():
        logits = target.verify(mx.array([block[:k]]), copy.deepcopy(prefilled), split).logits
        assert [np.array(logits[0, i]).tobytes() for i in range(k)] == steps[:k], (k, split)
