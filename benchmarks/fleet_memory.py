"""Several models under a memory budget they do not fit in together: does the server stay within it?

    python -m benchmarks.fleet_memory [--hidden 1024 --layers 12] [--minutes 10] [--clients 3] [--tokens 16]

Three random-weight llamas whose weights add to twice ``--memory-budget`` (so one is loaded at a time), behind
one ``mlxcel serve --models FILE``; *clients* threads send greedy completions for *minutes*,
each cycling through the three models from its own starting point, so that requests for different models
arrive together and every model is unloaded and loaded again many times. Prints the requests answered and
failed, the loads, the server's peak resident memory (VmHWM, from /proc) against the budget, and the runtime's
own overhead: the server's resident memory with nothing loaded (after every model has been unloaded for idleness
at the end), which no model's charge counts.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import BENCH_DIR, bench_model  # noqa: E402
from mlxcel.testing.serving import serve_subprocess  # noqa: E402

PROMPT = "def wrap(text, width=70):"


def server_pid(marker: str) -> int:
    """The pid of the server process whose command line holds *marker* (its models file)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_text().replace("\0", " ") and "serve" in \
                        (proc / "cmdline").read_text():
                    return int(proc.name)
            except OSError:
                continue
    raise RuntimeError(f"no server process with {marker} in its command line")


def memory_mb(pid: int, field: str) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert match is not None, field
    return int(match[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    paths = [bench_model("llama", args.hidden, args.layers, name=f"fleet-{n}-h{args.hidden}-l{args.layers}")
             for n in "abc"]
    weights = sum(f.stat().st_size for p in paths for f in p.glob("*.safetensors"))
    budget = weights // 2
    file = BENCH_DIR / "fleet-memory.toml"
    file.write_text("".join(f'[[models]]\npath = "{p}"\nnames = ["{n}"]\n\n' for n, p in zip("abc", paths,
                                                                                               strict=True)))
    print(f"three llamas of {weights / 3e9:.2f} GB, budget {budget / 1e9:.2f} GB (half their weights), "
          f"{args.clients} clients for {args.minutes:g} min")
    log = BENCH_DIR / f"fleet-memory-{time.time_ns()}.log"
    answered = failed = 0
    lock = threading.Lock()
    with serve_subprocess(["--models", str(file), "--memory-budget", str(budget), "--prompt-cache-bytes", "64M",
                           "--idle-unload", "20s"], {}, log, start_timeout=900) as url:
        pid = server_pid(str(file))
        start_rss = memory_mb(pid, "VmRSS")
        deadline = time.monotonic() + args.minutes * 60

        def client(offset: int) -> None:
            nonlocal answered, failed
            with httpx.Client(timeout=900) as http:
                turn = offset
                while time.monotonic() < deadline:
                    model = "abc"[turn % 3]
                    turn += 1
                    response = http.post(f"{url}/v1/completions", json={
                        "model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0})
                    with lock:
                        answered += response.status_code == 200
                        failed += response.status_code != 200
                    if response.status_code != 200:
                        print(f"  {model}: {response.status_code} {response.text[:200]}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with httpx.Client(timeout=60) as http:  # every model unloads once idle for 20 s: the runtime alone
            waited = time.monotonic()
            while any(m["loaded"] for m in http.get(f"{url}/v1/models").json()["data"]):
                if time.monotonic() - waited > 120:
                    break
                time.sleep(1)
            time.sleep(2)
        peak, idle = memory_mb(pid, "VmHWM"), memory_mb(pid, "VmRSS")
    loads = log.read_text().count(" is loaded")
    print(f"answered {answered}, failed {failed}, loads {loads}")
    print(f"peak resident {peak:.0f} MB against a budget of {budget / 1e6:.0f} MB; resident at start (one model "
          f"loaded) {start_rss:.0f} MB; with every model unloaded {idle:.0f} MB: peak - idle = "
          f"{peak - idle:.0f} MB (the budget's part), idle = the runtime's own overhead")


if __name__ == "__main__":
    main()
