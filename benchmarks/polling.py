"""Polling `/v1/internal/mtp-policy` during a long generation: poll latency, and what it costs decode.

    python -m benchmarks.polling [--pollers 50] [--tokens 512]

Runs the same long streamed generation with and without 50 concurrent pollers
(each polling every --interval seconds; 0 = back to back, a stress test),
alternating, and prints the poll latency p50/p99 and the decode ratio
with pollers / without. Target: decode slows by no more than 5%.
"""

from __future__ import annotations

import argparse
import threading
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402
import trio  # noqa: E402

from benchmarks._common import add_model_arguments, bench_model, median, percentile, server, stream_decode_rate  # noqa: E402

PROMPT = "def wrap(text, width=70, **kwargs):"


async def _get(stream: trio.SocketStream, request: bytes, buffer: bytearray) -> int:
    """One keep-alive GET over a raw socket; returns the status. A client this light keeps the
    measurement about the server: httpx's own per-request cost would dominate on a 2-core machine."""
    await stream.send_all(request)
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive_some(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    buffer[:] = rest[length:]
    return int(head.split(b" ", 2)[1])


def poll_until(url: str, pollers: int, interval: float, stop: threading.Event, latencies: list[float]) -> None:
    """*pollers* concurrent clients, each polling the endpoint every *interval* s, until *stop* is set."""
    host, port = url.removeprefix("http://").split(":")
    request = b"GET /v1/internal/mtp-policy HTTP/1.1\r\nHost: bench\r\n\r\n"

    async def poller(offset: float) -> None:
        await trio.sleep(offset)  # spread the pollers over the interval, as independent clients are
        stream = await trio.open_tcp_stream(host, int(port))
        buffer = bytearray()
        async with stream:
            while not stop.is_set():
                start = time.perf_counter()
                assert await _get(stream, request, buffer) == 200
                latencies.append(time.perf_counter() - start)
                await trio.sleep(max(0.0, interval - (time.perf_counter() - start)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(pollers):
                nursery.start_soon(poller, interval * i / pollers)

    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--interval", type=float, default=0.1,
                        help="seconds between one poller's polls; 0 polls back to back (default: %(default)s)")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for the server process (repeatable)")
    add_model_arguments(parser, rounds=3, tokens=512)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    print(f"model: {model.name}, {args.tokens} tokens, {args.pollers} pollers every {args.interval} s, "
          f"{args.rounds} rounds")
    quiet, polled, latencies = [], [], []
    env = dict(item.split("=", 1) for item in args.server_env)
    with server(model, "--parallel", "1", env=env) as url, httpx.Client(timeout=600) as client:
        stream_decode_rate(client, url, PROMPT, 16)
        for _ in range(args.rounds):
            quiet.append(stream_decode_rate(client, url, PROMPT, args.tokens))
            stop = threading.Event()
            round_latencies: list[float] = []
            thread = threading.Thread(target=poll_until, args=(url, args.pollers, args.interval, stop,
                                                                 round_latencies))
            thread.start()
            time.sleep(0.5)  # pollers at full speed before the generation starts
            polled.append(stream_decode_rate(client, url, PROMPT, args.tokens))
            stop.set()
            thread.join()
            latencies.extend(round_latencies)
    print(f"poll latency: p50 {percentile(latencies, 50) * 1000:.1f} ms, p99 {percentile(latencies, 99) * 1000:.1f} ms "
          f"over {len(latencies)} polls")
    print(f"decode without pollers: {median(quiet):8.1f} tok/s  {[round(x, 1) for x in quiet]}")
    print(f"decode with pollers:    {median(polled):8.1f} tok/s  {[round(x, 1) for x in polled]}")
    print(f"ratio with / without pollers: {median(polled) / median(quiet):.3f}")


if __name__ == "__main__":
    main()
