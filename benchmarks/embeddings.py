"""Embeddings: inputs per second through ``POST /v1/embeddings`` against mlx-embeddings' own call and
sentence-transformers on the same checkpoint and CPU.

    python -m benchmarks.embeddings [--size minilm base] [--rounds 3] [--inputs 256]

A random-weight BERT checkpoint in the sentence-transformers layout (``minilm``: 6 layers of 384, the shape of
all-MiniLM-L6-v2, 90 MB; ``base``: 12 of 768, bge-base's, 440 MB), and lines of Python source of 10-60 tokens
as inputs. Three sides, measured in turn in this one run, each on the same inputs, at batch 1 (one input a call,
one after another) and batch 32 (32 inputs a call):

- mlxcel: ``mlxcel serve --model CHECKPOINT`` in its own process, an httpx client sending float embeddings
  requests one after another (tokenization, HTTP, JSON included);
- mlx-embeddings: its ``generate`` (its tokenizer and forward, the output evaluated) in this process;
- sentence-transformers: ``SentenceTransformer.encode`` on torch's CPU build (skipped when not installed).

Prints inputs/s for each and mlxcel's ratio to the other two (the brief's bar: >= 0.95 of mlx-embeddings').
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import BENCH_DIR, median  # noqa: E402
from mlxcel.testing.serving import serve_subprocess  # noqa: E402

SIZES = {"minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
         "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}}


def checkpoint(size: str) -> Path:
    from mlxcel.testing.embeddings import build_embedding_checkpoint

    directory = BENCH_DIR / f"embedding-{size}"
    if not (directory / "model.safetensors").exists():
        build_embedding_checkpoint(directory, "bert", max_seq_length=256, vocab_size=8192,
                                   max_position_embeddings=512, **SIZES[size])
    return directory


def inputs(count: int) -> list[str]:
    """Lines of the standard library's source, 40-240 characters: 10-60 tokens each."""
    lines: list[str] = []
    for name in ("textwrap.py", "string.py", "glob.py", "argparse.py"):
        text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
        lines += [line.strip() for line in text.splitlines() if 40 <= len(line.strip()) <= 240]
    return lines[:count]


def rate(call: object, texts: list[str], batch: int, rounds: int) -> float:
    """Median inputs/s of ``call(batch of texts)`` over *rounds* passes through *texts*."""
    assert callable(call)
    call(texts[:batch])  # warm: first-call compilation, caches
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        for at in range(0, len(texts), batch):
            call(texts[at:at + batch])
        seconds.append(time.perf_counter() - start)
    return len(texts) / median(seconds)


def measure(path: Path, texts: list[str], rounds: int) -> dict[str, dict[int, float]]:
    """Inputs/s by side and batch for the checkpoint *path*."""
    rows: dict[str, dict[int, float]] = {}
    with serve_subprocess(["--model", str(path)], {}, BENCH_DIR / f"{path.name}.log") as url, \
            httpx.Client(base_url=url, timeout=300) as client:
        def served(batch: list[str]) -> None:
            client.post("/v1/embeddings", json={"input": batch}).raise_for_status()

        rows["mlxcel"] = {b: rate(served, texts, b, rounds) for b in (1, 32)}
    import mlx.core as mx
    from mlx_embeddings import generate, load

    model, tokenizer = load(str(path))

    def own(batch: list[str]) -> None:
        mx.eval(generate(model, tokenizer, batch, max_length=256).text_embeds)

    rows["mlx-embeddings"] = {b: rate(own, texts, b, rounds) for b in (1, 32)}
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: its side is skipped (pip install sentence-transformers)")
        return rows
    torch.set_num_threads(max(1, (torch.get_num_threads() or 2) - 1))  # as the server keeps a core
    encoder = SentenceTransformer(str(path), device="cpu")
    rows["sentence-transformers"] = {b: rate(lambda batch, b=b: encoder.encode(batch, batch_size=b), texts, b,
                                             rounds) for b in (1, 32)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", nargs="+", choices=sorted(SIZES), default=["minilm", "base"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=256)
    args = parser.parse_args()
    texts = inputs(args.inputs)
    print(f"{len(texts)} inputs, {args.rounds} rounds")
    for size in args.size:
        path = checkpoint(size)
        rows = measure(path, texts, args.rounds)
        print(f"\n{size} ({sum(f.stat().st_size for f in path.glob('model*.safetensors')) / 1e6:.0f} MB):")
        print(f"{'side':24} {'batch 1':>10} {'batch 32':>10}   inputs/s")
        for side, by_batch in rows.items():
            print(f"{side:24} {by_batch[1]:10.1f} {by_batch[32]:10.1f}")
        for other in [side for side in rows if side != "mlxcel"]:
            print(f"mlxcel / {other:15} {rows['mlxcel'][1] / rows[other][1]:10.2f} "
                  f"{rows['mlxcel'][32] / rows[other][32]:10.2f}")


if __name__ == "__main__":
    main()
