"""A start of an MTP pairing to a healthy server: probing its exactness, or taking what an earlier start found.

Each round starts ``mlxcel serve --model M --mtp`` twice, in a process of its own, on one fresh cache root: the
first start probes (the burst's verify and the batch's widths, ``engine/exactness.py``) and keeps the outcome,
the second takes it (``engine/probe_memo.py``). Prints each round's seconds from the process's start to the first
``/health`` 200, the medians and their ratio.

    python -m benchmarks.start_probes --model .bench/qwen35-aligned-0.001-l12-h1024-08b [--parallel 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from statistics import median

from mlxcel.testing.serving import serve_subprocess


def _start(model: Path, parallel: int, cache: Path, log: Path) -> float:
    started = time.monotonic()
    with serve_subprocess(["--model", str(model), "--mtp", "--parallel", str(parallel)],
                          {"MLXCEL_CACHE_DIR": str(cache)}, log, start_timeout=1200):
        healthy = time.monotonic() - started
    text = log.read_text()
    assert "MTP exactness probe: at K=" in text, text  # the pairing is exact: both probes' outcomes exist
    return healthy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint with an MTP head")
    parser.add_argument("--parallel", type=int, default=4, help="the batch's rows: the widths its probe checks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    probing, kept = [], []
    with tempfile.TemporaryDirectory(prefix="start-probes-") as scratch:
        for round_ in range(args.rounds):
            cache = Path(scratch) / f"cache-{round_}"
            probing.append(_start(args.model, args.parallel, cache, Path(scratch) / f"probing-{round_}.log"))
            kept.append(_start(args.model, args.parallel, cache, Path(scratch) / f"kept-{round_}.log"))
            print(f"round {round_ + 1}: probing {probing[-1]:.1f} s, kept {kept[-1]:.1f} s", flush=True)
    print(f"median: probing {median(probing):.1f} s, kept {median(kept):.1f} s, "
          f"ratio {median(probing) / median(kept):.2f}")


if __name__ == "__main__":
    main()
