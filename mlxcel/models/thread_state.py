"""What MLX keeps per thread, released at the end of a thread's MLX work."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def release_thread_state() -> None:
    """At the end of a thread's MLX work (the worker's, a follower's, the embedding engine's): drop what MLX keeps
    per thread (its streams and, with them since mlx 0.32.2, its ``mx.compile`` cache) now, while the interpreter
    runs, and give the thread a fresh default stream for its next job (trio's cached threads run others). Arrays
    this thread built and did not evaluate cannot be evaluated after it.

    Left to the thread's exit, the compile cache's entries take the GIL in a C++ destructor; a cached thread that
    idles out while the interpreter finalizes (a test process's end) is then stopped by Python inside that
    destructor, and the process aborts ("terminate called without an active exception"; mlx's maintainers ask for
    ``clear_streams`` at the end of every thread that used MLX)."""
    import mlx.core as mx

    mx.clear_streams()
    mx.set_default_stream(mx.new_stream(mx.default_device()))


@contextmanager
def released() -> Iterator[None]:
    """A thread's MLX work: whatever way the block ends, :func:`release_thread_state` after it."""
    try:
        yield
    finally:
        release_thread_state()
