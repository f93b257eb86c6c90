"""The process group: joining it, and what it adds to the hardware label.

The group is joined before the HTTP port is bound, because only rank 0 binds
one: the rank decides what this process is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The ``--distributed`` modes, after mlx-lm's two ways of sharding a model.
MODES = ("pipeline", "tensor")

#: mx.distributed backends, in the order they are tried. ``mx.distributed.init(backend="any")``
#: does not say which one it chose, and the hardware label must name it; jaccl and nccl are
#: only available where their hardware is, and mpi only under mpirun.
BACKENDS = ("jaccl", "nccl", "ring", "mpi")


class DistributedError(Exception):
    """``--distributed`` cannot run here; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the group."""

    mode: str
    """``pipeline`` or ``tensor``."""
    group: Any
    """The ``mx.distributed.Group`` of every rank."""
    backend: str
    rank: int
    size: int

    @property
    def leader(self) -> bool:
        """Rank 0 serves HTTP and drives the decode loop."""
        return self.rank == 0

    def hardware_label(self, host_label: str) -> str:
        """*host_label* with the world size and the backend, e.g. ``cpu-openblas-x86_64-Unknown-0c-ring-x2``.

        A measurement made across two processes says nothing about one, nor about another backend.
        """
        return f"{host_label}-{self.backend}-x{self.size}"


def join(mode: str) -> World:
    """Join the group ``mlx.launch`` (or mpirun) started this process in.

    Raises:
        DistributedError: no backend is configured, or the group has one process
            (``--distributed`` without ``mlx.launch``).
    """
    import mlx.core as mx

    failures = []
    for backend in BACKENDS:
        if not mx.distributed.is_available(backend):
            continue
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as exc:  # this backend is not configured for this process
            failures.append(f"{backend}: {exc}")
            continue
        if group.size() < 2:
            continue
        return World(mode, group, backend, group.rank(), group.size())
    raise DistributedError(
        f"--distributed {mode} needs a group of two or more processes, started by mlx.launch "
        f"(e.g. `mlx.launch -n 2 --backend ring -- mlxcel serve ... --distributed {mode}`)"
        + (f"; {'; '.join(failures)}" if failures else ""))
