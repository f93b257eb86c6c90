"""Every model family mlxcel knows more of than mlx-lm does: one module or folder each, found by ``model_type``.

A family (a subclass of :class:`Family`, an instance named ``FAMILY`` in its
module) says which ``model_type`` values it serves and overrides only what it
changes: config values mlx-lm must be given, changes to the loaded model, its
own cache classes, its own model file, its speculative target and its drafter.
:func:`family` finds it: every public module of this package is a family, so
a new family is a new module here and nothing else (:class:`Family` itself is
in ``_family``, which a family imports rather than this package). A ``model_type`` no family
claims is a plain mlx-lm family (:data:`PLAIN`).

A family module imports no mlx at import time (it is read before the port is
bound, before the BLAS is chosen); its targets, heads and model files live
in its folder's submodules, imported when used.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from ._family import Family

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


PLAIN = Family()


@functools.cache
def _families() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_"):
            continue  # _family: what a family is, not one
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
