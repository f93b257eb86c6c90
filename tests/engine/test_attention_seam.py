"""mlx's attention is replaced in one place, and mlxcel's rules apply only on a declared MLX thread: an
in-process server's worker attends grouped while the test's own thread, at the same depth, gets mlx's."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import attention, thread_state


def _lone_query() -> tuple[mx.array, mx.array, mx.array]:
    """One query of 4 heads over 2 KV heads and 300 keys: what the grouped rule takes."""
    q = mx.random.normal((1, 4, 1, 16), key=mx.random.key(0))
    k, v = (mx.random.normal((1, 2, 300, 16), key=mx.random.key(i)) for i in (1, 2))
    mx.eval(q, k, v)  # evaluated here: another thread computes with them (MLX streams are per thread)
    return q, k, v


def test_the_rules_apply_on_the_mlx_thread_and_nowhere_else() -> None:
    seen: list[str] = []

    def recorded(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return mx.zeros(q.shape)

    attend = attention.dispatching(recorded)
    q, k, v = _lone_query()
    worker_inside = threading.Event()
    main_done = threading.Event()

    def worker() -> None:
        with attention.mlx_thread():
            attend(q, k, v, scale=0.25)  # grouped: the recorder is not called
            worker_inside.set()
            main_done.wait(10)  # the main thread attends while this one is still an MLX thread
            attend(q, k, v, scale=0.25)
        attend(q, k, v, scale=0.25)  # the block is over: mlx's own again

    thread = threading.Thread(target=worker, name="worker")
    thread.start()
    assert worker_inside.wait(10)
    attend(q, k, v, scale=0.25)  # the main thread never declared itself
    main_done.set()
    thread.join()
    assert seen == [threading.current_thread().name, "worker"]


def test_the_installed_dispatcher_leaves_other_threads_bit_for_bit_as_mlx() -> None:
    q, k, v = _lone_query()
    with attention.mlx_thread():
        installed = mx.fast.scaled_dot_product_attention
        grouped = installed(q, k, v, scale=0.25)
    assert getattr(installed, "mlxcel_dispatch", False)
    with attention.mlx_thread():  # installed once: a second declaration does not wrap it again
        assert mx.fast.scaled_dot_product_attention is installed
    results: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: results.append(np.array(mx.fast.scaled_dot_product_attention(
        q, k, v, scale=0.25))))
    thread.start()
    thread.join()
    mlx_own = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)  # this thread: not an MLX thread now
    np.testing.assert_array_equal(results[0], np.array(mlx_own))
    assert mx.allclose(grouped, mlx_own, atol=1e-5).item()  # the same attention, its sums grouped


def test_a_query_at_a_time_is_refused_off_an_mlx_thread() -> None:
    with pytest.raises(AssertionError, match="MLX thread"), attention.one_query_at_a_time():
        pass
    with attention.mlx_thread():
        with attention.one_query_at_a_time(), attention.one_query_at_a_time():
            pass  # nests, and restores what it found
        with attention.one_query_at_a_time():
            pass


def test_a_thread_whose_mlx_work_ended_has_its_compile_cache_released_and_can_run_mlx_again() -> None:
    """The worker runs on trio's cached threads, which outlive it. At its end it releases what MLX keeps per thread
    (left to the thread's exit, its compile cache takes the GIL in a C++ destructor, and a test process aborted when
    that exit fell in the interpreter's finalization), and leaves the thread a stream for its next job: without one
    it fails with "There is no Stream(cpu, 0) in current thread"."""
    results: list[Any] = []

    def jobs() -> None:
        doubled = mx.compile(lambda x: x * 2)
        with attention.mlx_thread():
            results.append(doubled(mx.array([1.0, 2.0])).tolist())
        thread_state.release_thread_state()
        results.append((mx.array([3.0]) + 1).tolist())  # the same thread's next job
        results.append(doubled(mx.array([4.0])).tolist())  # compiled anew: the cache was emptied

    thread = threading.Thread(target=jobs)
    thread.start()
    thread.join()
    assert results == [[2.0, 4.0], [4.0], [8.0]]
