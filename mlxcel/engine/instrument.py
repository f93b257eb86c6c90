"""Where tests reach into the worker: one object, passed once, that production runs without.

A test subclasses :class:`Instrument` and hands it to the engine (``ServeConfig.instrument``);
the worker calls :meth:`Instrument.before_load` as its thread starts and
:meth:`Instrument.at` at each of :data:`POINTS` for the request being served there.
An exception raised at a point is a fault at that point (the fault-isolation tests);
a sleep there slows that step (the responsiveness tests). Without an instrument
(every server a user starts) the worker makes none of these calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from .requests import GenerationRequest

Point = Literal["prefill", "solo_step", "verify", "sampler", "batch_step", "score"]
POINTS: tuple[Point, ...] = ("prefill", "solo_step", "verify", "sampler", "batch_step", "score")
"""A prefill chunk of a solo sequence; a classic solo step; an MTP verify; a sample (solo or in the batch);
a batch step (once per sequence in it); a chunk of a prompt's scores (``echo`` with ``logprobs``)."""

Probe = Callable[[Point], None]
"""An instrument bound to one request: what the decoders call at their points."""


class Instrument:
    """The default does nothing at every hook; a test overrides the ones it needs."""

    def before_load(self) -> None:
        """On the worker thread, before the model loads (a test holds the load here)."""

    def at(self, point: Point, request: GenerationRequest) -> None:
        """On the worker thread, at *point* while serving *request*."""

    def probe(self, request: GenerationRequest) -> Probe:
        return lambda point: self.at(point, request)


class Hooks(Instrument):
    """An instrument from plain functions: ``Hooks(at=..., before_load=...)``."""

    def __init__(self, at: Callable[[Point, GenerationRequest], None] | None = None,
                 before_load: Callable[[], None] | None = None) -> None:
        self._at, self._before_load = at, before_load

    def before_load(self) -> None:
        if self._before_load is not None:
            self._before_load()

    def at(self, point: Point, request: GenerationRequest) -> None:
        if self._at is not None:
            self._at(point, request)
