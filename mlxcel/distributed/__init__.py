"""One model across processes: ``mlx.launch ... mlxcel serve --distributed pipeline|tensor``.

MLX's own distributed engine (``mx.distributed``, started by ``mlx.launch``)
connects the processes, and mlx-lm's own sharded loading splits the model
(``sharded_load``: a family's ``model.pipeline(group)`` or ``model.shard(group)``).
Rank 0 serves HTTP and runs the engine as usual, with the model wrapped in a
:class:`~mlxcel.distributed.mirror.Leader`; every other rank runs
:func:`~mlxcel.distributed.follower.run_follower`, which makes the same forward
calls in the same order. docs/scaling.md ("One model across hosts") and
docs/architecture.md describe the protocol.

Nothing here is family-specific, and nothing at import time imports mlx.
"""

from .world import MODES, DistributedError, World, join

__all__ = ["MODES", "DistributedError", "World", "join"]
