"""The engine: the model, continuous batching and the MTP policy, on one worker thread.

Importing this package does not import mlx; the worker imports it on its own thread.
"""

from .engine import Engine, EngineUnavailable, QueueFull
from .messages import WorkerSettings
from .requests import Event, Finish, GenerationRequest, PromptLogprobs, SamplingParams, TextDelta, Timings

__all__ = [
    "Engine",
    "EngineUnavailable",
    "Event",
    "Finish",
    "GenerationRequest",
    "PromptLogprobs",
    "QueueFull",
    "SamplingParams",
    "TextDelta",
    "Timings",
    "WorkerSettings",
]
