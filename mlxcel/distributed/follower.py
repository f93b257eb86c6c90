"""A rank other than 0: no HTTP, no engine; load this rank's shard and run rank 0's calls until it stops."""

from __future__ import annotations

import logging
import signal

from ..models.loader import CheckpointInfo
from .world import World

logger = logging.getLogger(__name__)


def run_follower(checkpoint: CheckpointInfo, world: World) -> None:
    """Serve rank 0's model calls; returns when rank 0 says stop.

    SIGINT is ignored: a Ctrl-C in the terminal running ``mlx.launch`` reaches
    every rank, and a follower that left in the middle of a forward would leave
    rank 0 waiting on it. Rank 0 shuts down gracefully and then tells the
    followers to stop. SIGTERM (what ``mlx.launch`` sends when a rank fails)
    still ends a follower at once.

    Raises:
        CheckpointError: the shard cannot be loaded.
        RuntimeError: rank 0 sent something this rank cannot follow, or a collective failed.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..models.attention import mlx_thread
    from ..models.thread_state import released
    from .load import load_shard
    from .mirror import follow

    with released(), mlx_thread():  # every rank attends as a single process would
        model, _ = load_shard(checkpoint, world)
        logger.info("rank %d/%d: following rank 0", world.rank, world.size)
        calls = follow(model, world.group)
    logger.info("rank %d/%d: rank 0 stopped after %d model calls; exiting", world.rank, world.size, calls)
