"""The solo decoder's edge cases, on a tiny hybrid checkpoint with an MTP head."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.mtp import Drafter, TargetModel
from mlxcel.engine.requests import BurstStats
from mlxcel.engine.solo import SoloDecoder
from mlxcel.models.drafters import DrafterSpec
from mlxcel.models.drafters.loader import load_drafter
from tests.checkpoints import build_mtp_checkpoint


@pytest.fixture(scope="module")
def pairing(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, object, object]:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("solo") / "qwen35", drafter="aligned", context_scale=0.0)
    model, _ = load(str(path))
    head = load_drafter(DrafterSpec(path=path, name="qwen35#mtp", in_checkpoint=True), path)
    return TargetModel(model), model, head


def test_a_round_with_the_whole_prompt_cached_starts_with_a_classic_step(
        pairing: tuple[TargetModel, object, object]) -> None:
    target, model, head = pairing
    prompt = [5, 17, 99, 123, 7, 8]
    stream = mx.default_stream(mx.default_device())
    # The prefix cache covered all but the last prompt token: nothing left to prefill, no hidden state yet.
    cache = make_prompt_cache(model)
    target.forward(mx.array([prompt[:-1]]), cache)
    solo = SoloDecoder.prefill(target, stream, None, cache, prompt[:-1], prompt[-1:], 512,
                               Drafter(head, target))
    assert not solo.can_draft  # so the burst starts with a classic step, which gives the head its state
    first = [solo.classic_step()[0]]
    assert solo.can_draft
    stats = BurstStats()
    solo.start_round(4, "wide")
    second = solo.finish_round(stats)
    assert stats.rounds == 1 and len(second) == 4  # the aligned head: every draft accepted

    reference = make_prompt_cache(model)
    logits, _ = target.forward(mx.array([prompt]), reference)
    greedy = [int(mx.argmax(logits[0, -1]).item())]
    for _ in range(4):
        logits, _ = target.forward(mx.array([greedy[-1:]]), reference)
        greedy.append(int(mx.argmax(logits[0, -1]).item()))
    assert first + second == greedy
