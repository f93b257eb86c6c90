"""What ``--distributed`` refuses, each in one line before anything binds, and what the leader refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.cli import build_parser
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.serve_cli import build_serve_config
from mlxcel.testing.checkpoints import build_checkpoint
from mlxcel.usage import UsageError


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("refusals")
    return {"llama": build_checkpoint(root / "llama-tiny", "llama"),
            "qwen3_5": build_mtp_checkpoint(root / "qwen35-tiny")}


def _config(*argv: str) -> object:
    return build_serve_config(build_parser().parse_args(["serve", "--port", "0", *argv]))


@pytest.mark.parametrize(("family", "mode", "message"), [
    ("llama", "pipeline", "mlx-lm cannot pipeline llama (no PipelineMixin model); try --distributed tensor"),
    ("qwen3_5", "pipeline", "has no model.safetensors.index.json, which mlx-lm's pipeline loading reads"),
    ("llama", "tensor", "--distributed tensor needs a group of two or more processes, started by mlx.launch"),
])
def test_refused_before_binding(models: dict[str, Path], family: str, mode: str, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        _config("--model", str(models[family]), "--distributed", mode)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_leader_refuses_what_its_followers_could_not_mirror(models: dict[str, Path]) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.distributed.mirror import Leader

    model, _ = load(str(models["llama"]))
    leader = Leader(model, mx.distributed.init())  # a group of one: its sums are the identity
    tokens = mx.array([[1, 2, 3]])
    cache = make_prompt_cache(leader)
    assert mx.array_equal(leader(tokens, cache=cache), model(tokens, cache=make_prompt_cache(model)))
    leader(mx.array([[4]]), cache=cache)  # the same cache goes on
    with pytest.raises(RuntimeError, match="only start a sequence from an empty cache"):
        filled = make_prompt_cache(model)
        model(tokens, cache=filled)
        leader(mx.array([[4]]), cache=filled)
    with pytest.raises(TypeError, match="takes only tokens and a cache"):
        leader(tokens, cache=None, input_embeddings=None)
    leader.stop()
    with pytest.raises(RuntimeError, match="followers have been stopped"):
        leader(tokens)
