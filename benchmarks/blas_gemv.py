"""The BLAS's own one-row product, outside mlx: how fast can a B=1 step read its weights at all?

    python -m benchmarks.blas_gemv [--library PATH] [--threads 1 2]

A B=1 decode step is, for its weights, one ``(1, K) x (K, N)`` product per
matrix. mlx hands those to ``cblas_sgemm``; this calls the library directly with
ctypes (``cblas_sgemv`` and the 1-row ``cblas_sgemm``, on numpy arrays, 1 GiB of
weights per shape, best of 3) and prints the read rate each reaches, next to the
machine's read bandwidth (numpy summing 1 GiB on 1 and on 2 threads). So it
shows the ceiling the kernel itself puts on decode, with nothing of mlx or
mlxcel in the way. Default library: MKL from the ``mkl`` wheel, the fastest at
one row here (docs/blas.md).
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import numpy as np

#: (out, in): a hidden-1024 model's products (q/o, gate/up, down), and a 4096-wide one's.
SHAPES = [(1024, 1024), (3072, 1024), (1024, 3072), (4096, 4096)]
GIB = 1 << 30


def read_bandwidth(threads: int) -> float:
    """GB/s of *threads* threads summing 1 GiB between them (numpy releases the GIL): best of 3."""
    buffer = np.ones(GIB // 4, dtype=np.float32)
    parts = np.array_split(buffer, threads)
    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=part.sum) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - start)
    return GIB / best / 1e9


def product_rates(library: ctypes.CDLL, shape: tuple[int, int]) -> tuple[float, float]:
    """GB/s of weights read by ``y = W x`` (sgemv) and ``y = x W^T`` (1-row sgemm) over 1 GiB of *shape*."""
    rows, columns = shape
    weights = [np.random.rand(rows, columns).astype(np.float32) for _ in range(GIB // (rows * columns * 4))]
    x, y = np.random.rand(columns).astype(np.float32), np.zeros(rows, dtype=np.float32)
    one, zero, pointer = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_void_p
    row_major, no_trans, trans = 101, 111, 112

    def gemv(w: np.ndarray) -> None:
        library.cblas_sgemv(row_major, no_trans, rows, columns, one, pointer(w.ctypes.data), columns,
                            pointer(x.ctypes.data), 1, zero, pointer(y.ctypes.data), 1)

    def gemm(w: np.ndarray) -> None:
        library.cblas_sgemm(row_major, no_trans, trans, 1, rows, columns, one, pointer(x.ctypes.data), columns,
                            pointer(w.ctypes.data), columns, zero, pointer(y.ctypes.data), rows)

    rates = []
    for call in (gemv, gemm):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for w in weights:
                call(w)
            best = min(best, time.perf_counter() - start)
        rates.append(len(weights) * w.nbytes / best / 1e9)
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", help="a CBLAS shared library (default: the mkl wheel's libmkl_rt)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if args.library is None:
        from mlxcel.blas import mkl_library

        found = mkl_library()
        if found is None:
            raise SystemExit("no --library given and the mkl wheel is not installed (pip install 'mlxcel[mkl]')")
        args.library = str(found)
    library = ctypes.CDLL(args.library, mode=ctypes.RTLD_GLOBAL)
    set_threads = getattr(library, "MKL_Set_Num_Threads", None) or library.openblas_set_num_threads
    print(f"library: {args.library}")
    print(f"read bandwidth (numpy sum of 1 GiB): 1 thread {read_bandwidth(1):.1f} GB/s, "
          f"2 threads {read_bandwidth(2):.1f} GB/s")
    print(f"{'threads':>7} {'shape (out x in)':>16} {'sgemv GB/s':>10} {'1-row sgemm GB/s':>16}")
    for threads in args.threads:
        set_threads(ctypes.c_int(threads))
        for shape in SHAPES:
            gemv, gemm = product_rates(library, shape)
            print(f"{threads:>7} {f'{shape[0]} x {shape[1]}':>16} {gemv:>10.1f} {gemm:>16.1f}")
    print(f"read bandwidth again: 1 thread {read_bandwidth(1):.1f} GB/s")


if __name__ == "__main__":
    main()
