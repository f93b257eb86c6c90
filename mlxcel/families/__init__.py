"""Every model family mlxcel knows more of than mlx-lm does: one module or folder each, found by ``model_type``.

A family (a subclass of :class:`Family`, an instance named ``FAMILY`` in its
module) says which ``model_type`` values it serves and overrides only what it
changes: config values mlx-lm must be given, changes to the loaded model, its
own cache classes, its own model file, its speculative target and its drafter.
:func:`family` finds it: every module of this package is a family, so a new
family is a new module here and nothing else. A ``model_type`` no family
claims is a plain mlx-lm family (:data:`PLAIN`).

A family module imports no mlx at import time (it is read before the port is
bound, before the BLAS is chosen); its targets, heads and model files live
in its folder's submodules, imported when used.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..models.drafters import DrafterSpec
    from ..models.loader import CheckpointInfo
    from ..models.speculative import DraftHead, SpeculativeTarget

#: model_type -> why mlx-lm's continuous batch is wrong for it (mlx-lm 0.32.x); found by
#: ``tests/server/test_families.py`` and reproduced with mlx-lm's own ``BatchGenerator``, without
#: mlxcel. mlxcel serves those one sequence at a time. Remove an entry when mlx-lm fixes it: the
#: test then checks its batch again.
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


class Family:
    """A plain mlx-lm family: what every hook does unless a family overrides it."""

    model_types: tuple[str, ...] = ()
    """The ``model_type`` values (``config.json``) this family serves."""
    own_model: bool = False
    """mlxcel carries the model file (mlx-lm has none): :meth:`model_classes` builds it."""
    mtp: bool = False
    """The family has a speculative target and a drafter kind (:meth:`target`, :meth:`inspect_drafter`)."""
    head_type: str | None = None
    """Its drafter's kind, as a standalone head's ``config.json`` names it (``model_type``)."""

    def config_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        """Config values mlx-lm must be given on top of the checkpoint's ``config.json``."""
        return {}

    def prepare(self, model: Any) -> None:
        """Change the loaded model in place before anything runs on it."""

    def adopt_cache(self, cache: list[Any]) -> list[Any]:
        """*cache* (a sequence's, from mlx-lm's batch or the prefix cache) in the family's own cache classes."""
        return cache

    def cache_classes(self) -> tuple[type, ...]:
        """The family's own cache classes (beside mlx-lm's), which a prompt cache file may name: each
        rebuilds itself with ``from_state``."""
        return ()

    def model_classes(self, config: dict[str, Any]) -> tuple[Any, Any]:
        """(Model, ModelArgs) of an own model file: mlx-lm's ``load_model(get_model_classes=...)``."""
        raise NotImplementedError(f"model_type {config.get('model_type')!r} is mlx-lm's own")

    def target(self, model: Any) -> SpeculativeTarget:
        """The speculative target adapter around the loaded model (worker thread; :attr:`mtp` families only)."""
        raise NotImplementedError

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None) -> DrafterSpec:
        """Check the drafter (``--mtp``: the target's own head; else *draft_model*) before the port is bound;
        reads only JSON and safetensors headers. Raises :class:`~mlxcel.models.drafters.DrafterError`."""
        from ..models.drafters import DrafterError

        raise DrafterError(f"model_type {target.model_type!r} has no MTP head mlxcel can run "
                           f"(supported: {', '.join(sorted(mtp_model_types()))})")

    def load_head(self, spec: DrafterSpec, target: CheckpointInfo,
                  model: Any) -> tuple[Any, Callable[[Any], DraftHead]]:
        """The head *spec* names (an ``nn.Module``, not yet evaluated: it may be quantized first) and what
        makes the drafter of the loaded target *model* from it (worker thread)."""
        raise NotImplementedError

    def split_head(self, source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
                   quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
        """``mlxcel split-mtp``: write the raw checkpoint *source*'s head to *out* as a standalone drafter."""
        from ..models.drafters import DrafterError

        raise DrafterError(f"split-mtp extracts the MTP head of {', '.join(sorted(split_model_types()))} "
                           f"checkpoints; {source} is a {config.get('model_type')!r} one")


PLAIN = Family()


@functools.cache
def _families() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        declared = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if isinstance(declared, Family):
            found.update(dict.fromkeys(declared.model_types, declared))
    return found


def family(model_type: str) -> Family:
    """The family serving *model_type*: one of this package's, or :data:`PLAIN`."""
    return _families().get(model_type, PLAIN)


def mtp_model_types() -> list[str]:
    """Every ``model_type`` whose MTP mlxcel can run."""
    return sorted(t for t, f in _families().items() if f.mtp)


def head_types() -> set[str]:
    """Every drafter kind a family runs."""
    return {f.head_type for f in _families().values() if f.head_type}


def split_model_types() -> list[str]:
    """Every ``model_type`` whose head ``mlxcel split-mtp`` can write out."""
    return sorted(t for t, f in _families().items() if type(f).split_head is not Family.split_head)


def own_model_types() -> list[str]:
    """Every ``model_type`` mlxcel carries the model file of."""
    return sorted(t for t, f in _families().items() if f.own_model)
