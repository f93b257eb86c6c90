"""A prompt's image tokens and the image features that take their places, for the vision families' prefills."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def image_rows(tokens: np.ndarray, image_token_id: int, features: list[mx.array]) -> tuple[np.ndarray, mx.array]:
    """Where *tokens* hold *image_token_id*, and *features* stacked: a row for each of those places, in order.
    A ValueError when the counts differ (a prompt rendered for other images)."""
    where = np.nonzero(tokens == image_token_id)[0]
    rows = mx.concatenate(features, axis=0) if features else mx.zeros((0, 1))
    if len(where) != rows.shape[0]:
        raise ValueError(f"the prompt holds {len(where)} image tokens for {rows.shape[0]} image features")
    return where, rows
