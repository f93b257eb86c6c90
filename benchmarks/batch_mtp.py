"""MTP inside the continuous batch: aggregate tokens/s with ``--mtp`` over without, at several widths.

    python -m benchmarks.batch_mtp [--streams 1 2 4 8 16] [--drafter aligned --context 0.0] [--k 4]
        [--layers 24 --hidden 1024 | --layers 12 --released] [--tokens 64] [--rounds 2] [--depth TOKENS] [--always]
        [--against-mlx-lm] [--before TREE [--before-env NAME=VALUE ...] [--before-sides on off]] [--warm] [--step-log]
        [--processes N] [--generations G]
        [--distinct] [--prompt-cache-bytes SIZE] [--fresh]

For each width N, N greedy completions sent at once to each server in turn
(rounds alternating between them, all servers up side by side in one run):
``off`` serves the checkpoint without ``--mtp`` (mlx-lm's classic batched step
only), ``on`` with ``--mtp`` and no pin (the per-step rule picks K, parking
speculation where it loses), and with ``--always`` also ``always`` (MTP pinned
on: K - 1 drafts at every step that can draft). Prints the median aggregate
tokens/s of each (completion tokens over the round's wall time), the ratios,
and the steps the ``on`` server took at each K (its ``/metrics``). The regret
of the rule is ``on`` against the better of ``off`` and ``always``. With
``--against-mlx-lm``, ``mlx_lm.server`` on the same checkpoint and BLAS is a
fourth column. ``--before TREE``: ``on`` as another source tree serves it (a ``git worktree`` of an earlier
commit), and ``on/before``;
``--before-sides``: which sides that tree serves (``on``, the default: ``before``; ``off``: ``off_before``, and
``off/before``, a change to the classic batch);
``--before-env``: settings only that server gets (``--before . --before-env GLIBC_TUNABLES=glibc.malloc.hugetlb=1``:
this tree on huge pages). ``--step-log``: every server logs each batch step (rows, depth, drafts, seconds, drafts
kept) to its log in ``.bench/``, and each width's line is followed by the speculating sides' tokens/s inside their
steps of that width, and on/always there: the rule's choices against always-on's, the rounds' admissions left out
(``benchmarks/_step_log.py``). ``--processes N``: N servers for each side, a round on each in turn (round r on the
r-th mod N), so that a side's figure is not one process's: two processes of one build can differ by 3-8% for their
whole lives (docs/benchmarks.md, 2026-12-05, seventh); each process's own median is printed too (a server of
``--layers 12 --released`` holds 2.3-2.7 GB: three sides of three left 1 GB of 23 free; at ``--depth 2048`` and 16
streams 3.3 GB, and one of nine was killed for memory).
``--generations G``: every server started G times in turn (a set of fresh processes each time, in the same cache
directories: a restart keeps its persisted costs, as on a user's machine), and every width's rounds run on each set;
the figures over all of them come last, with ``on/best`` of each generation. So a side's figure is G processes'
where G sets would not fit in memory at once.
``--warm``: each width's first round untimed, for every server (the rule's first steps at a width measure it,
as a server does once per machine: its costs persist; every server's first steps at a width pay for new
shapes). ``--released``: the pairing's layers shaped as Qwen3.5-0.8B's (8 query heads of 256 over 2 KV heads,
a full-attention layer in four, gated-delta heads of 128; 12 layers of them are ~1 GB in fp32), not the
synthetic 16-wide heads ``--hidden`` gives. ``--depth N`` sends one prompt to every stream, N tokens of words
then a line of code (each server prefills it once, while warming up): at temperature 0 every row then writes the
same text, and keeps or rejects each draft with the others. With ``--distinct``, each stream's prompt is the same
N tokens (a long system prompt, as the sub-agents of one coding agent share) and then its own line, as token ids;
each server prefills the shared part once, sent alone while warming up (a hybrid model's prefix cache resumes a
prompt from the state kept at the end of an earlier one), and each stream's line on top of it. A server then holds
one prompt's caches per stream: at 2k and 16 streams, 4.2-5.0 GB each with the default prefix-cache bound (an
eighth of memory), and six of them did not fit in 23 GB (``--prompt-cache-bytes``; ``--processes 1``). Before
anything is timed, ``on`` serves lone requests until its B=1 policy has settled (a server's first few lone
requests, once per machine). The machine's free memory is compacted before the servers start, where this process
may (``compact_memory``). ``--fresh``: each round's prompts end with the round's number, so that every request
leaves entries no server has seen, as an agent's turns do (with ``--prompt-cache-bytes`` small enough, every
finished request evicts entries to the disk tier). Every server has a cache directory of its own, as servers on
separate machines would: its own persisted costs, and its own prefix-cache disk tier (one process owns a
directory's tier, so on a shared one only the first server up wrote its evictions to disk, in its worker's turn
until 2026-12-06).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from itertools import count
from pathlib import Path
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import compact_memory, complete, context_window, median, mlx_lm_server, mtp_model, server, words  # noqa: E402
from benchmarks._step_log import StepLog  # noqa: E402

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:",
           "def dedent(text):", "if __name__ == '__main__':", "x = {}", "    return", "while True:",
           "try:", "with open(path) as f:", "import re", "def main():", "@property", "raise ValueError(",
           "async def fetch(url):"]


Prompt = str | list[int]
"""A prompt as text, or as token ids (a shared context, then a stream's own line: its ids are the context's)."""


def one(client: httpx.Client, url: str, prompt: Prompt, tokens: int, model: str | None) -> int:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, **({"model": model} if model else {})}
    response = client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


def aggregate(client: httpx.Client, url: str, prompts: list[Prompt], tokens: int, model: str | None = None) -> float:
    """Completion tokens per second of *prompts* sent at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        total = sum(pool.map(lambda p: one(client, url, p, tokens, model), prompts))
        return total / (time.perf_counter() - start)


def settle(client: httpx.Client, url: str, prompt: Prompt, tokens: int) -> str:
    """Lone requests to the ``--mtp`` server at *url* until its B=1 policy has settled (what a server does in
    its first few lone requests, once per machine: its verdict persists), so that one stream measures the
    settled policy and the rule, not the profiling window; the verdict it reached."""
    for _ in range(16):
        policy = client.get(f"{url}/v1/internal/mtp-policy").json()
        if policy["state"] != "profiling":
            break
        one(client, url, prompt, tokens, None)
    return f"{policy['state']} ({policy['verdict']})"


def steps_by_k(client: httpx.Client, urls: list[str]) -> dict[int, int]:
    """Batch steps taken at each K, summed over the servers at *urls* (their ``/metrics``)."""
    steps: dict[int, int] = {}
    for url in urls:
        text = client.get(f"{url}/metrics").text
        for m in re.finditer(r'^mlxcel_batch_steps_total\{drafts="(\d+)"\} (\S+)$', text, re.M):
            steps[int(m[1])] = steps.get(int(m[1]), 0) + int(float(m[2]))
    return steps


def each(urls: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Every (side, server URL), a side's processes in order."""
    return [(side, url) for side, processes in urls.items() for url in processes]


def setting(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` as a pair, or an argparse error that says what was expected."""
    name, equals, value = text.partition("=")
    if not name or not equals:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, help="a checkpoint with an in-checkpoint MTP head "
                        "(default: a synthetic pairing built from --drafter and --context)")
    parser.add_argument("--drafter", default="aligned", choices=["aligned", "random"])
    parser.add_argument("--context", type=float, default=0.0,
                        help="target's context dependence (0: the head always agrees)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--k", type=int, default=4, help="verify width (drafts per row: K - 1)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--released", action="store_true", help="layers shaped as Qwen3.5-0.8B's (hidden 1024)")
    parser.add_argument("--depth", type=int, default=0, help="tokens of context every prompt shares")
    parser.add_argument("--distinct", action="store_true",
                        help="with --depth: each stream its own line after the shared context (rows of their own "
                             "texts), not one prompt for all")
    parser.add_argument("--fresh", action="store_true",
                        help="each round's prompts end with the round's number: entries no server has seen, as "
                             "an agent's turns are, so that with the prefix cache's memory full every finished "
                             "request evicts entries to the disk tier")
    parser.add_argument("--always", action="store_true", help="also MTP pinned on (for the rule's regret)")
    parser.add_argument("--warm", action="store_true", help="each width's first round untimed, on every server")
    parser.add_argument("--against-mlx-lm", action="store_true")
    parser.add_argument("--before", type=Path, help="also `on` as this source tree (a git worktree) serves it")
    parser.add_argument("--step-log", action="store_true",
                        help="servers log every step (--log-level debug) to their files in .bench/")
    parser.add_argument("--before-sides", nargs="+", default=["on"], choices=["on", "off"],
                        help="with --before: the sides that tree serves too (before, off_before)")
    parser.add_argument("--before-env", nargs="+", default=[], metavar="NAME=VALUE", type=setting,
                        help="environment settings of `before` (with `--before .`: this tree, other settings)")
    parser.add_argument("--prompt-cache-bytes", metavar="SIZE",
                        help="every mlxcel server's prefix cache bound (its default is an eighth of memory: six "
                             "servers at 2k, 16 streams of their own prompts held 4.2-5.0 GB each, and one was "
                             "killed for memory)")
    parser.add_argument("--processes", type=int, default=1,
                        help="servers for each side, taking rounds in turn (mlx_lm.server: one)")
    parser.add_argument("--generations", type=int, default=1,
                        help="start every server this many times in turn, each time with the same cache directory, "
                             "and run every width's rounds on each (a side's figure over several processes, with "
                             "only one set of them in memory)")
    args = parser.parse_args()
    positions = context_window(args.depth + args.tokens, 4096)
    model = args.model or mtp_model(args.drafter, args.context, args.layers, args.hidden, positions, args.released)
    if args.distinct and not args.depth:
        parser.error("--distinct takes --depth (the context the streams share; without one every stream's prompt is "
                     "its own line already)")
    if args.against_mlx_lm and args.depth and args.distinct:
        parser.error("--against-mlx-lm does not take --depth with --distinct (mlx_lm.server reads prompts as text, "
                     "and would prefill the shared context once a stream)")
    prompts: list[Prompt] = list(PROMPTS)
    shared: list[Prompt] = []  # what each server prefills once, while warming up
    tokenizer: Any = None  # with --depth: the model's, which the prompts' ids come from

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    if args.depth:
        import random

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        filler = words(tokenizer, args.depth, random.Random(0))
        if not args.distinct:  # one prompt for every stream
            prompts = shared = [filler + "\n" + PROMPTS[0]]
        else:  # ids, so that each stream's prompt starts with exactly the context's tokens
            context = ids(filler)
            shared = [context]
            prompts = [context + ids("\n" + line) for line in PROMPTS]
    widest = max(args.streams)
    parallel = ("--parallel", str(widest), *(("--log-level", "debug") if args.step_log else ()),
                *(("--prompt-cache-bytes", args.prompt_cache_bytes) if args.prompt_cache_bytes else ()))
    env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(args.k)}
    print(f"model: {model.name}, K = {args.k}, {args.tokens} tokens a request, {args.rounds} rounds"
          f"{f', after {args.depth} tokens of context' if args.depth else ''}"
          f"{', each stream its own line after it' if args.distinct else ''}"
          f"{', each width after an untimed round' if args.warm else ''}")
    print(f"memory: {compact_memory()}")
    rounds = count()  # with --fresh, every round's texts are new, across generations too

    def round_of(streams: int) -> list[Prompt]:
        """The prompts of a round of *streams*; with ``--fresh``, each ends with the round's number."""
        batch = [prompts[i % len(prompts)] for i in range(streams)]
        if not args.fresh:
            return batch
        tag = f"  # round {next(rounds)}"
        return [p + tag if isinstance(p, str) else p + ids(tag) for p in batch]

    pooled: dict[int, dict[str, list[float]]] = {streams: {} for streams in args.streams}
    each_generation: dict[int, list[dict[str, float]]] = {streams: [] for streams in args.streams}
    with ExitStack() as kept, httpx.Client(timeout=7200) as client:
        directories: dict[tuple[str, int], str] = {}

        def directory(side: str, index: int) -> str:
            """A server's cache directory, the same for its side and index in every generation: a restarted
            server keeps its persisted costs and verdict, as on a user's machine."""
            if (side, index) not in directories:
                directories[side, index] = kept.enter_context(tempfile.TemporaryDirectory())
            return directories[side, index]

        for generation in range(args.generations):
            if generation:
                print(f"generation {generation + 1} of {args.generations}: every server started again "
                      f"({compact_memory()})", flush=True)
            with ExitStack() as stack:
                def servers(side: str, *flags: str, env: dict[str, str] = env, tree: Path | None = None) -> list[str]:
                    """Every server a cache directory of its own: its own persisted costs, and its own disk tier (one
                    process owns a directory's tier: on a shared one only the first server up wrote its
                    evictions)."""
                    return [stack.enter_context(server(model, *flags, *parallel, tree=tree, env={
                        **env, "MLXCEL_CACHE_DIR": directory(side, index)})) for index in range(args.processes)]

                urls = {"off": servers("off"), "on": servers("on", "--mtp", "--metrics")}
                if args.always:
                    urls["always"] = servers("always", "--mtp", "--metrics", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"})
                if args.before:
                    own = {**env, **dict(args.before_env)}
                    if "on" in args.before_sides:
                        urls["before"] = servers("before", "--mtp", "--metrics", env=own, tree=args.before)
                    if "off" in args.before_sides:
                        urls["off_before"] = servers("off_before", env=own, tree=args.before)
                if args.against_mlx_lm:
                    urls["mlx_lm"] = [stack.enter_context(mlx_lm_server(model, "--decode-concurrency", str(widest)))]
                for streams, rates in one_generation(args, client, urls, model, prompts, shared, round_of).items():
                    for side, values in rates.items():
                        pooled[streams].setdefault(side, []).extend(values)
                    each_generation[streams].append({side: median(values) for side, values in rates.items()})
    if args.generations > 1:
        # A ratio of pooled medians can lie outside every generation's own ratio (the machine's speed moves between
        # generations, and each side's rounds pool differently), so each generation's ratios, taken side by side
        # in one set of processes, come too, with their median.
        print(f"every generation's rounds together ({args.generations} x {args.rounds} a side), then each "
              "generation's ratios and their median:")
        print(header(list(pooled[args.streams[0]]), args))
        for streams, rates in pooled.items():
            print(line(streams, {side: median(values) for side, values in rates.items()}, args))
            generations = each_generation[streams]
            ratios = {"on/off": [g["on"] / g["off"] for g in generations]}
            if args.always:
                ratios["on/best"] = [g["on"] / max(g["off"], g["always"]) for g in generations]
            for name, values in ratios.items():
                print(f"{'':>7}   {name} by generation: " + " ".join(f"{r:.2f}" for r in values)
                      + f"; median {median(values):.2f}", flush=True)


def header(sides: list[str], args: argparse.Namespace) -> str:
    return (f"{'streams':>7} " + " ".join(f"{side:>9}" for side in sides) + f" {'on/off':>7}"
            + (f" {'on/best':>7}" if args.always else "") + (f" {'on/mlx':>7}" if args.against_mlx_lm else "")
            + (f" {'on/bef':>7}" if "before" in sides else "") + (f" {'off/bef':>7}" if "off_before" in sides else ""))


def line(streams: int, mid: dict[str, float], args: argparse.Namespace) -> str:
    """A width's medians by side, and their ratios."""
    text = f"{streams:>7} " + " ".join(f"{rate:>9.1f}" for rate in mid.values()) + f" {mid['on'] / mid['off']:>7.2f}"
    if args.always:
        text += f" {mid['on'] / max(mid['off'], mid['always']):>7.2f}"
    if args.against_mlx_lm:
        text += f" {mid['on'] / mid['mlx_lm']:>7.2f}"
    if "before" in mid:
        text += f" {mid['on'] / mid['before']:>7.2f}"
    if "off_before" in mid:
        text += f" {mid['off'] / mid['off_before']:>7.2f}"
    return text


def one_generation(args: argparse.Namespace, client: httpx.Client, urls: dict[str, list[str]], model: Path,
                   prompts: list[Prompt], shared: list[Prompt],
                   round_of: Callable[[int], list[Prompt]]) -> dict[int, dict[str, list[float]]]:
    """Every width's rounds on the servers at *urls* (printed as they finish); each side's rates by width."""
    def named(side: str) -> str | None:
        return str(model) if side == "mlx_lm" else None

    for side, url in each(urls):  # compile and fill caches before anything is timed
        if shared:  # the context prefilled once: every stream's prompt resumes from its end
            aggregate(client, url, shared, 1, named(side))
        aggregate(client, url, (prompts * 2)[:2], 8, named(side))  # and a batch's first steps (at that depth)
    for side in ("on", "before") if "before" in urls else ("on",):
        for url in urls[side]:
            print(f"the B=1 policy of `{side}`: {settle(client, url, prompts[0], args.tokens)}")
    if args.depth and args.distinct:  # what every stream's prompt takes from the prefix cache
        last = prompts[-1]
        body = complete(client, urls["on"][0], last, 1)
        print(f"a stream's prompt: {body['usage']['prompt_tokens_details']['cached_tokens']} of {len(last)} "
              "tokens from the prefix cache")
    print(header(list(urls), args) + "  steps by K (on)")
    # With --step-log, the speculating sides' rates inside their steps too (benchmarks/_step_log.py).
    logs = {(side, url): StepLog(url) for side, url in each(urls)
            if args.step_log and side in ("on", "always", "before")}
    result: dict[int, dict[str, list[float]]] = {}
    for streams in args.streams:
        if args.warm:
            batch = round_of(streams)
            for side, url in each(urls):
                aggregate(client, url, batch, args.tokens, named(side))
        before = steps_by_k(client, urls["on"])
        for log in logs.values():
            log.mark()
        rates: dict[str, list[float]] = {side: [] for side in urls}
        by_process: dict[str, list[float]] = {url: [] for _, url in each(urls)}
        for turn in range(args.rounds):
            batch = round_of(streams)
            for side, processes in urls.items():
                url = processes[turn % len(processes)]
                rate = aggregate(client, url, batch, args.tokens, named(side))
                rates[side].append(rate)
                by_process[url].append(rate)
        after = steps_by_k(client, urls["on"])
        steps = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(after)}
        mid = {side: median(values) for side, values in rates.items()}
        print(line(streams, mid, args) + "  " + " ".join(f"K{k}:{n}" for k, n in steps.items() if n), flush=True)
        if streams > 1 and logs:
            print(inside_the_steps(streams, logs), flush=True)
        if args.processes > 1:
            print("        each process: " + "; ".join(
                f"{side} " + " ".join(f"{median(by_process[url]):.1f}" for url in processes)
                for side, processes in urls.items()), flush=True)
        result[streams] = rates
    return result


def inside_the_steps(streams: int, logs: dict[tuple[str, str], StepLog]) -> str:
    """Each speculating side's tokens/s inside its steps of *streams* rows since the logs' marks (its processes
    together), and on / always: the rule's choices of K against always-on's, without the rounds' admissions."""
    tokens: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    for (side, _), log in logs.items():
        made, spent = log.inside(streams)
        tokens[side] += made
        seconds[side] += spent
    rate = {side: tokens[side] / spent for side, spent in seconds.items() if spent}
    text = f"{'':>7}   inside the {streams}-row steps: " + (", ".join(f"{side} {r:.1f}" for side, r in rate.items())
                                                         or "none logged (the rows never ran all together)")
    return text + (f"; on/always {rate['on'] / rate['always']:.2f}" if {"on", "always"} <= rate.keys() else "")


if __name__ == "__main__":
    main()
