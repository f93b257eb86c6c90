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
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.drafters.own_cache import OwnCacheSequence

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


def test_a_batch_prefilled_rows_head_holds_its_whole_prompt(pairing: tuple[Any, Any, Any]) -> None:
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


def test_a_rows_queue_keeps_its_last_positions_only() -> None:
    """A long prompt's hidden states wait for its row to decode: the queue keeps the last MAX_QUEUED of them."""
    from types import SimpleNamespace

    from mlxcel.models.drafters.own_cache import MAX_QUEUED, OwnCacheBatch

    drafts = OwnCacheBatch(SimpleNamespace(head=SimpleNamespace(make_cache=list)))
    drafts.join(7, None)
    for start in range(0, MAX_QUEUED + 1000, 300):  # chunks of 300 positions, as a prefill hands them over
        positions = mx.arange(start, start + 300)
        drafts.catch_up(7, positions.reshape(1, -1, 1).astype(mx.float32), positions.reshape(1, -1))
    assert drafts.pending(7) == MAX_QUEUED
    queued = mx.concatenate([tokens for _, tokens in drafts._pending[7]], axis=1)
    last = (MAX_QUEUED + 1000 + 299) // 300 * 300
    assert queued[0, 0].item() == last - MAX_QUEUED and queued[0, -1].item() == last - 1
    drafts.catch_up(8, positions.reshape(1, -1, 1), positions.reshape(1, -1))  # a row not joined: ignored
    assert drafts.pending(8) == 0
