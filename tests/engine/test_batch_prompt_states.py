"""A row the continuous batch prefills has its drafter read its whole prompt, as a lone sequence's does.

mlx-lm's batched prefill runs the model over chunks of the rows' prompts (each prompt alone: engine/batch.py)
and keeps no hidden states; the tap runs those chunks through the target's forward and keeps them, so by the
time a row decodes its head's cache holds every prompt position: the same keys and values the head of a lone
sequence holds after reading the same prompt (the B=1 burst's catch-up), not just the positions since the row's
first step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.checkpoints import inspect_checkpoint, inspect_drafter, load_drafter, speculative_target
from mlxcel.engine.batch import ContinuousBatch
from mlxcel.engine.batch_speculation import BatchSpeculation
from mlxcel.engine.requests import BurstStats
from mlxcel.families.qwen3_5.mtp import Qwen35MTP, text_args
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.drafters.own_cache import OwnCacheBatch, OwnCacheSequence, _chain
from mlxcel.testing.checkpoints import CONFIGS

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")

PROMPTS = [[3 + (7 * i) % 97 for i in range(37)], [5 + (11 * i) % 89 for i in range(70)]]
CHUNK = 16  # the batch's prefill chunk: several chunks a prompt


@pytest.fixture(scope="module")
def pairing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("prompt-states") / "qwen35", drafter="aligned",
                                context_scale=0.05)
    info = inspect_checkpoint(path)
    model, _ = load(str(path))
    return model, speculative_target(info.model_type, model), load_drafter(
        inspect_drafter(info, mtp=True, draft_model=None), info, model)


@pytest.mark.parametrize("piece", [None, 8], ids=["read-at-first-draft", "read-while-prefilling"])
def test_a_batch_prefilled_rows_head_holds_its_whole_prompt(pairing: tuple[Any, Any, Any], piece: int | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if piece is not None:  # pieces smaller than the prompts: each row reads its prompt alone as it arrives
        monkeypatch.setattr("mlxcel.models.drafters.own_cache.SETTLE_CHUNK", piece)
    model, target, head = pairing
    speculation = BatchSpeculation(model, target, head, "wide")
    batch: ContinuousBatch[object] = ContinuousBatch(model, frozenset(), 2, CHUNK,
                                                     mx.default_stream(mx.default_device()), speculation, None)
    uids = []
    for prompt in PROMPTS:
        uid = batch.insert(object(), prompt, None, [], 50, None, [])
        speculation.join(uid, None, None, BurstStats(), True)
        uids.append(uid)
    first: dict[int, int] = {}
    steps = dict.fromkeys(uids, -1)  # the tokens each row decoded, less the one still unpaired
    while len(first) < len(PROMPTS) or min(steps.values()) < 2:
        for _, response in batch.step().tokens:
            first.setdefault(response.uid, response.token)
            steps[response.uid] += 1
    order = list(batch._generator._generation_batch.uids)
    mx.eval(speculation.drafts.settle(order))
    batch.close()

    for uid, prompt in zip(uids, PROMPTS, strict=True):
        # A lone sequence's head after reading the prompt (and the first token decoded after it).
        cache = make_prompt_cache(model)
        _, hidden = target.forward(mx.array([prompt]), cache)
        alone = OwnCacheSequence(head)
        alone.catch_up(hidden, mx.array([[*prompt[1:], first[uid]]]))
        alone.settle()
        row = order.index(uid)
        for batched, own in zip(speculation.drafts._cache, alone._cache, strict=True):
            extracted = batched.extract(row)
            # Every prompt position read, once, and the steps since after them.
            assert own.offset == len(prompt) and extracted.offset == len(prompt) + steps[uid]
            np.testing.assert_allclose(np.array(extracted.keys[..., :own.offset, :]),
                                       np.array(own.keys[..., :own.offset, :]), rtol=1e-4, atol=1e-5)


def test_a_prefilling_rows_long_prompt_is_read_as_it_arrives(pairing: tuple[Any, Any, Any]) -> None:
    """A row still prefilling reads each whole SETTLE_CHUNK of its prompt's hidden states as the chunks arrive:
    its queue stays under a chunk, and the state it joins the drafting rows with holds every position before
    that, the keys and values a lone sequence's head holds after the same positions."""
    from mlxcel.models.drafters.own_cache import SETTLE_CHUNK

    model, target, head = pairing
    length = 2 * SETTLE_CHUNK + 100
    prompt = [3 + (7 * i) % 97 for i in range(length + 1)]
    _, hidden = target.forward(mx.array([prompt[:-1]]), make_prompt_cache(model))
    tokens = mx.array([prompt[1:]])
    drafts = OwnCacheBatch(head)
    joined = OwnCacheSequence(head)
    drafts.join(7, joined)
    for start in range(0, length, 300):  # pieces of 300 positions, as a prefill hands them over
        drafts.catch_up(7, hidden[:, start:start + 300], tokens[:, start:start + 300])
        assert drafts.pending(7) < SETTLE_CHUNK
    assert drafts.pending(7) == length - 2 * SETTLE_CHUNK and drafts.ready(7)
    alone = OwnCacheSequence(head)
    alone.catch_up(hidden[:, :2 * SETTLE_CHUNK], tokens[:, :2 * SETTLE_CHUNK])
    alone.settle()
    for read, own in zip(joined._cache, alone._cache, strict=True):
        assert read.offset == own.offset == 2 * SETTLE_CHUNK
        np.testing.assert_allclose(np.array(read.keys[..., :own.offset, :]), np.array(own.keys[..., :own.offset, :]),
                                   rtol=1e-4, atol=1e-5)
    drafts.catch_up(8, hidden[:, :300], tokens[:, :300])  # a row not joined: ignored
    assert drafts.pending(8) == 0


def _head(kind: str) -> tuple[Any, int]:
    """A random head of *kind* and its hidden size: Qwen 3.5's of one layer or two, GLM-4.7-Flash's."""
    if kind == "glm":
        from mlxcel.families.glm4_moe_lite.mtp import _new_head
        from mlxcel.families.glm4_moe_lite.tiny import EXTRA, TEXT

        return _new_head({**TEXT, **EXTRA}), TEXT["hidden_size"]
    args = text_args(CONFIGS["qwen3_5"])
    return Qwen35MTP(args, num_layers=2 if kind == "qwen-2" else 1), args.hidden_size


@pytest.mark.parametrize("kind", ["qwen", "qwen-2", "glm"])
def test_catching_up_writes_the_keys_and_values_a_whole_forward_writes(kind: str) -> None:
    """A head catching up reads its output at the last position only: ``remember`` writes the other positions'
    keys and values alone. The same positions read whole, then the last one: the same cache to the bit, and the
    same output (the last position's forward is the same one-position forward either way). With two layers
    the first runs whole (the second's keys depend on its output); GLM's layer keeps compressed keys."""
    head, hidden_size = _head(kind)
    mx.eval(head.parameters())
    rng = np.random.default_rng(len(kind))
    embeddings, hidden = (mx.array(rng.normal(size=(1, 9, hidden_size)).astype(np.float32)) for _ in range(2))
    whole, caught_up = head.make_cache(), head.make_cache()
    head(embeddings[:, :5], hidden[:, :5], whole)  # an earlier read: the new positions are written after it
    head(embeddings[:, :5], hidden[:, :5], caught_up)
    head(embeddings[:, 5:8], hidden[:, 5:8], whole)
    head.remember(embeddings[:, 5:8], hidden[:, 5:8], caught_up)
    expected = head(embeddings[:, 8:], hidden[:, 8:], whole)
    out = head(embeddings[:, 8:], hidden[:, 8:], caught_up)
    assert caught_up[-1].offset == whole[-1].offset == 9
    for a, b in zip(whole, caught_up, strict=True):
        assert np.array_equal(np.array(a.keys[..., :9, :]), np.array(b.keys[..., :9, :]))
        assert np.array_equal(np.array(a.values[..., :9, :]), np.array(b.values[..., :9, :]))
    assert np.array_equal(np.array(expected), np.array(out))


def test_a_batch_of_rows_catching_up_drafts_as_each_row_read_whole(pairing: tuple[Any, Any, Any]) -> None:
    """Rows with different numbers of queued positions (right-padded, then rotated to the left) draft, after a
    catch-up that writes all but each row's last position by ``remember``, what each would draft having read
    every position whole, alone."""
    model, target, head = pairing
    drafts = OwnCacheBatch(head)
    states = {}
    for uid, prompt in enumerate(PROMPTS):
        cache = make_prompt_cache(model)
        _, hidden = target.forward(mx.array([prompt]), cache)
        states[uid] = (hidden[:, :-1], mx.array([prompt[1:]]))
        drafts.join(uid, None)
        drafts.catch_up(uid, *states[uid])
    batched = drafts.draft([0, 1], 3, []).tolist()
    for uid, (hidden, tokens) in states.items():
        alone = head.head.make_cache()
        last = head.head(head.embed(tokens), hidden, alone)[:, -1:, :]  # every position read whole
        assert _chain(head, last, alone, 3).tolist()[0] == batched[uid]
