"""What the engine's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxcel.models import attention


@pytest.fixture
def on_an_mlx_thread() -> Iterator[None]:
    """The test's thread drives the model as the engine's worker does: its attention goes through mlxcel's
    rules (:mod:`mlxcel.models.attention`), and a ``rows`` verify, which asserts that, may run on it."""
    with attention.mlx_thread():
        yield
