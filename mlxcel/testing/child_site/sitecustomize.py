"""Prepares a test's child process (``mlxcel serve``, a script) to start as a user's would, only sooner.

:func:`mlxcel.testing.serving.child_env` puts this directory first on the child's ``PYTHONPATH``, and Python's
``site`` imports this module at start-up. Two things:

- **torch hidden**, as a user's install (which has no torch) would. When torch is installed, transformers
  imports it on the way to ``AutoTokenizer`` (``configuration_utils`` imports ``modeling_rope_utils``, which
  imports torch if ``importlib.util.find_spec("torch")`` finds it), and transformers 5 has no switch to stop
  it: ~2.5 s of every child's start and ~0.4 s of its exit, for an import a server never uses (the dev extra
  installs torch only for the parity references, which run in the test process). A ``None`` entry in
  ``sys.modules`` makes ``find_spec`` answer None and ``import torch`` fail, exactly as without it.
- **transformers' import structure read, not scanned**, where the test process shared its own
  (:func:`mlxcel.testing.serving.share_import_structures`, named by :data:`STRUCTURES`). At every import,
  transformers reads each of its ~3,400 files for its ``__all__`` (``create_import_structure_from_path``, twice:
  for ``transformers`` and for ``transformers.models``): a server child's imports took 2.05 s scanning, 1.29 s
  reading the shared scan (docs/benchmarks.md, 2026-12-07, twentieth). The scan is a function of the installed
  files alone, and the test process runs the same install: its result answers the same two calls here; any
  other call is scanned as before.
"""

import importlib.abc
import importlib.machinery
import os
import pickle
import sys

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # None: "not importable", as documented

#: The environment variable naming the file of shared structures (module path -> pickled structure); the test
#: process sets it (``mlxcel.testing.serving.IMPORT_STRUCTURES``: this module imports nothing of mlxcel's).
STRUCTURES = "MLXCEL_TEST_IMPORT_STRUCTURES"
_SCANNER = "transformers.utils.import_utils"


class _SharedStructures(importlib.abc.MetaPathFinder):
    """Finds transformers' scanner as the path finder does, and has its loader answer the shared calls."""

    def __init__(self, structures: dict[str, bytes]) -> None:
        self._structures = structures

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _SCANNER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, structures = spec.loader.exec_module, self._structures

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            scan = module.create_import_structure_from_path

            def create_import_structure_from_path(module_path):  # type: ignore[no-untyped-def]
                shared = structures.get(str(module_path))
                return scan(module_path) if shared is None else pickle.loads(shared)

            module.create_import_structure_from_path = create_import_structure_from_path

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _share() -> None:
    path = os.environ.get(STRUCTURES)
    if not path:
        return
    try:
        with open(path, "rb") as file:
            structures = pickle.load(file)
    except OSError:
        return  # the test process is gone or never wrote it: the child scans, as any process does
    sys.meta_path.insert(0, _SharedStructures(structures))


_share()
