"""What mlxcel knows about mlx-lm's families beyond what their caches say.

mlx-lm decides whether a model's caches can merge into a batch; for a few
families its batched decode is wrong even so (found by
``tests/server/test_families.py``, and reproduced with mlx-lm's own
``BatchGenerator``, without mlxcel). mlxcel serves those one sequence at a
time, like a model whose caches cannot merge. Remove an entry when mlx-lm fixes
it: the test then checks its batch again.

And the few changes a family needs at load (:func:`config_overrides`, :func:`prepare`), and the
families mlxcel carries its own model file for (:data:`OWN_MODELS`), which mlx-lm does not have.
"""

from __future__ import annotations

from typing import Any

#: model_type -> why mlx-lm's continuous batch is wrong for it (mlx-lm 0.32.x).
BATCH_BROKEN = {
    "gemma2": "mlx-lm's gemma2 attention cannot take the batch's mask: broadcast_shapes (B,1,1,L) "
              "against (B,n_kv,n_rep,1,L) raises",
    "gpt_bigcode": "mlx-lm's gpt_bigcode takes positions from cache[0].offset, which is an array in a "
                   "batch cache (ValueError)",
    # mlx-lm's own BatchGenerator, given prompts of different lengths, decodes these
    # differently from model(x).
    "afm7": "mlx-lm's batched decode differs from model(x)",
    "mamba": "mlx-lm's batched decode differs from model(x)",
    "nemotron_h": "mlx-lm's batched decode differs from model(x)",
    "olmo_hybrid": "mlx-lm's batched decode differs from model(x)",
}


#: model_type -> the module under ``mlxcel.models`` whose ``Model``/``ModelArgs`` build it.
OWN_MODELS = {"inkling_mm_model": "inkling", "inkling_text": "inkling"}


def own_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """(Model, ModelArgs) of an :data:`OWN_MODELS` family: mlx-lm's ``load_model(get_model_classes=...)``."""
    import importlib

    module = importlib.import_module(f"{__package__}.{OWN_MODELS[config['model_type']]}")
    return module.Model, module.ModelArgs


#: model_type -> the module under ``mlxcel.models`` holding the family's load hooks: any of
#: ``config_overrides(config)``, ``prepare(model)`` and ``adopt_cache(cache)`` (below).
LOAD_HOOKS = {"gemma4": "gemma4", "gemma4_text": "gemma4"}


def _hook(model_type: str, name: str) -> Any:
    import importlib

    module = LOAD_HOOKS.get(model_type)
    return getattr(importlib.import_module(f"{__package__}.{module}"), name, None) if module else None


def config_overrides(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    """Config values mlx-lm must be given on top of a checkpoint's ``config.json`` (a family's quirks)."""
    hook = _hook(model_type, "config_overrides")
    return hook(config) if hook else {}


def prepare(model_type: str, model: Any) -> None:
    """A family's changes to the loaded mlx-lm model, before anything runs on it (in place): Gemma 4's
    sliding-window caches, for classic decode and the burst alike."""
    if hook := _hook(model_type, "prepare"):
        hook(model)


def adopt_cache(model_type: str, cache: list[Any]) -> list[Any]:
    """*cache* (a sequence's, from mlx-lm's batch or prefix cache) in the family's own cache classes."""
    hook = _hook(model_type, "adopt_cache")
    return hook(cache) if hook else cache
