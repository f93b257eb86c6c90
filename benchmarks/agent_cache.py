"""An agent's trace replayed: time to first token per turn with the prefix cache, without it, and after a restart.

    python -m benchmarks.agent_cache [--families llama qwen3_5] [--head 2000] [--turns 6] [--sessions 2] [--mlx-lm]

Each session is an agent loop: a fixed head (system prompt and tools, shared by
every session), a first user message of its own, then per turn the assistant's
reply (about --reply tokens) and a tool result (about --tool tokens), the whole
conversation resent each time; the sessions' turns interleave. Every request
asks for one token (``max_tokens: 1``), so its time is its time to first token.
The same trace runs against a server with its prefix cache, against one
without (``--prompt-cache-size 0``), and against a server restarted on the first
one's cache directory (the disk tier), which is sent the next turn of each known
conversation; for a hybrid model (Qwen 3.5's recurrent layers) and a llama of
the same size. With ``--mlx-lm``, the same turns also go to ``mlx_lm.server``
with its own prompt cache (same BLAS, loaded first). Prints, per turn, the
milliseconds each way and the ratio cached / uncached.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import context_model, context_window, median, mlx_lm_server, peak_mb, server, words  # noqa: E402


def trace(checkpoint: Path, args: argparse.Namespace) -> list[list[list[dict[str, str]]]]:
    """Per session, the conversation as sent at each turn (turns + 1: the last is for after the restart)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rng = random.Random(0)
    head = {"role": "system", "content": words(tokenizer, args.head, rng)}
    sessions = []
    for session in range(args.sessions):
        messages = [head, {"role": "user", "content": f"Task {session}: " + words(tokenizer, 40, rng)}]
        turns = [list(messages)]
        for _ in range(args.turns):
            messages += [{"role": "assistant", "content": words(tokenizer, args.reply, rng)},
                         {"role": "user", "content": "Tool result: " + words(tokenizer, args.tool, rng)}]
            turns.append(list(messages))
        sessions.append(turns)
    return sessions


def ask(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json={"messages": messages,
                                                                "max_tokens": 1, "temperature": 0})
    response.raise_for_status()
    return (time.perf_counter() - start) * 1000, response.json()


def replay(checkpoint: Path, sessions: list[list[list[dict[str, str]]]], turns: range, *argv: str,
           theirs: bool = False) -> dict[tuple[int, int], tuple[float, dict[str, Any]]]:
    """(session, turn) -> (milliseconds, body), the sessions' turns interleaved; *theirs*: mlx_lm.server."""
    out = {}
    ours = not theirs
    with (server(checkpoint, *argv, "--props") if ours else mlx_lm_server(checkpoint, *argv)) as url, \
            httpx.Client(timeout=3600) as client:
        for turn in turns:
            for index, conversation in enumerate(sessions):
                out[index, turn] = ask(client, url, conversation[turn])
        if ours:
            stats = client.get(f"{url}/v1/cache/stats").json()
            name = " ".join(argv) or "(prefix cache on)"
            print(f"  mlxcel serve {name}: peak resident {peak_mb(url):.0f} MB, prefix cache "
                  f"{stats['bytes'] / 2**20:.0f} of {stats['max_bytes'] / 2**20:.0f} MB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--head", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--reply", type=int, default=200)
    parser.add_argument("--tool", type=int, default=500)
    parser.add_argument("--mlx-lm", action="store_true", help="also replay the turns against mlx_lm.server")
    args = parser.parse_args()
    context = context_window(args.head + args.turns * (args.reply + args.tool), slack=2048)
    for family in args.families:
        checkpoint = context_model(family, args.hidden, args.layers, context)
        weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 1e6
        sessions = trace(checkpoint, args)
        turns = range(args.turns)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["MLXCEL_CACHE_DIR"] = cache  # the restart reads what the first server wrote
            cached = replay(checkpoint, sessions, turns)
            restarted = replay(checkpoint, sessions, range(args.turns, args.turns + 1))
        cold = replay(checkpoint, sessions, range(args.turns + 1), "--prompt-cache-size", "0")
        mlx_lm = replay(checkpoint, sessions, turns, theirs=True) if args.mlx_lm else {}
        print(f"\n{family}: {weights:.0f} MB of weights, head {args.head} tokens, {args.sessions} sessions "
              f"x {args.turns} turns (+{args.reply} reply, +{args.tool} tool result each)")
        print("session turn  prompt  cached   with cache   without   ratio" +
              ("   mlx_lm.server (cached)  ratio" if mlx_lm else ""))
        ratios, theirs = [], []
        for (session, turn), (ms, body) in sorted({**cached, **restarted}.items(), key=lambda kv: kv[0][::-1]):
            cold_ms = cold[session, turn][0]
            mark = " (after restart)" if turn == args.turns else ""
            other = ""
            if (session, turn) in mlx_lm:
                their_ms, their_body = mlx_lm[session, turn]
                their_cached = their_body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                other = f" {their_ms:10.0f} ms ({their_cached:6d})  {their_ms / cold_ms:5.2f}"
                if turn > 0:
                    theirs.append(their_ms / cold_ms)
            print(f"{session:7d} {turn:4d} {body['usage']['prompt_tokens']:7d} {body['timings']['cached_n']:7d} "
                  f"{ms:10.0f} ms {cold_ms:7.0f} ms  {ms / cold_ms:5.2f}{other}{mark}")
            if 0 < turn < args.turns:
                ratios.append(ms / cold_ms)
        after = [restarted[s, args.turns][0] / cold[s, args.turns][0] for s in range(args.sessions)]
        print(f"{family}: turns 2+ median ratio {median(ratios):.3f} (target <= 0.15); after a restart "
              f"median ratio {median(after):.3f} (target <= 0.25)")
        if theirs:
            print(f"{family}: mlx_lm.server turns 2+ median ratio {median(theirs):.3f} (to mlxcel without a cache)")


if __name__ == "__main__":
    main()
