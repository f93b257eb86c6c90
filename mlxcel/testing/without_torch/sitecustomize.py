"""Hides torch from a test's `mlxcel` child process, as a user's install (which has no torch) would.

:func:`mlxcel.testing.serving.child_env` puts this directory first on the child's
``PYTHONPATH``, and Python's ``site`` imports the module at start-up. Why: when torch
is installed, transformers imports it on the way to ``AutoTokenizer``
(``configuration_utils`` imports ``modeling_rope_utils``, which imports torch if
``importlib.util.find_spec("torch")`` finds it), and transformers 5 has no switch
to stop it. That is ~2.5 s of every child's start and ~0.4 s of its exit, for an
import a server never uses: the dev extra installs torch only for the parity
references, which run in the test process. A ``None`` entry in ``sys.modules``
makes ``find_spec`` answer None and ``import torch`` fail, exactly as without it.
"""

import sys

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # None: "not importable", as documented
