"""Images: time to first token for one screenshot and a short question, mlxcel against mlx-vlm's own call.

    python -m benchmarks.image_ttft [--family gemma4 qwen3_5] [--size tiny large] [--rounds 3] [--mlx-vlm-server]
    python -m benchmarks.image_ttft --family gemma4 qwen3_5 --size large --rounds 3 --interleave
    python -m benchmarks.image_ttft --size medium --throughput 4

A random-weight vision checkpoint built with transformers. Gemma 4 (:mod:`mlxcel.families.gemma4.tiny_vision`):
``tiny`` (the tests' own, patch 4, at most 70 image tokens) and ``large`` (text: 12 layers of 1024; vision: 12 of
768, patch 16, at most 280 image tokens, Gemma 4's default budget; 1.2 GB in float32). Qwen 3.5
(:mod:`mlxcel.families.qwen3_5.tiny_vision`): ``tiny`` (the tests' own, at most 64 image tokens) and ``large``
(text: 12 layers of 1024, 9 gated-delta and 3 full attention, heads of 256 with Qwen 3.5's multi-axis rotary
dims; vision: 12 of 768, patch 16, Qwen's default pixel bounds, so 768 image tokens for the screenshot; 1.2 GB in
float32). One 1024 x 768 image
(a rendered gradient with text-like stripes) and "What is in this screenshot?". Time to first token is the time of
a request for one token: mlxcel's through ``mlxcel serve`` in its own process (HTTP, the image's checks and
decoding included), cold (an image it has not seen), again (its vision features kept by the image's hash, its
prompt in the prefix cache), and as an agent's next turn (the same image, an answer and a new question);
mlx-vlm's through its ``generate`` with ``max_tokens=1`` in this process (its processor and
vision tower included). Prints the medians and mlxcel's ratio (mlx-vlm / mlxcel: above 1.0, mlxcel is faster).
"""

from __future__ import annotations

import argparse
import base64
import io
import time
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks._common import BENCH_DIR, median  # noqa: E402
from mlxcel.testing.serving import serve_subprocess  # noqa: E402

QUESTION = "What is in this screenshot?"
QWEN_SIZES = {
    "tiny": {},
    "large": {"text_sizes": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
                             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                             "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                             "linear_value_head_dim": 128,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                                 "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                 "mrope_interleaved": True}},
              "vision_sizes": {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
                               "num_position_embeddings": 2304},
              "pixels": (65_536, 16_777_216)},
}
SIZES = {
    "tiny": {},
    "medium": {"text_sizes": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
                              "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
                              + ["sliding_attention"] * 3 + ["full_attention"],
                              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                              "global_head_dim": 64, "sliding_window": 512, "hidden_size_per_layer_input": 0},
               "vision_sizes": {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 4,
                                "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 64,
                                "patch_size": 16, "position_embedding_size": 1024},
               "max_soft_tokens": 280},
    "large": {"text_sizes": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
                             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
                             + ["sliding_attention"] * 5 + ["full_attention"],
                             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                             "global_head_dim": 128, "sliding_window": 512, "hidden_size_per_layer_input": 0},
              "vision_sizes": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64,
                               "patch_size": 16, "position_embedding_size": 1024},
              "max_soft_tokens": 280},
}


def checkpoint(size: str, family: str = "gemma4") -> Path:
    if family == "qwen3_5":
        from mlxcel.families.qwen3_5.tiny_vision import build_vision_checkpoint as build_qwen

        directory = BENCH_DIR / f"qwen35-vision-{size}"
        if not (directory / "model.safetensors").exists():
            build_qwen(directory, **QWEN_SIZES[size])  # type: ignore[arg-type]
        return directory
    from mlxcel.families.gemma4.tiny_vision import build_vision_checkpoint

    directory = BENCH_DIR / f"gemma4-vision-{size}"
    if not (directory / "model.safetensors").exists():
        build_vision_checkpoint(directory, **SIZES[size])  # type: ignore[arg-type]
    return directory


def screenshot() -> Image.Image:
    """A 1024 x 768 image with the texture of a screen: a gradient, and stripes of varying grey like lines of text."""
    y, x = np.mgrid[0:768, 0:1024]
    base = np.stack([x * 255 // 1023, y * 255 // 767, (x + y) * 255 // 1790], axis=-1).astype(np.uint8)
    lines = ((y // 12) % 2 == 0) & ((x // 7) % 9 != 0)
    base[lines] = (base[lines] // 3).astype(np.uint8)
    return Image.fromarray(base)


def _data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def mlxcel_ttft(path: Path, image: Image.Image, rounds: int) -> tuple[float, float, float]:
    """(cold: another image each time, its features computed; cached: the same image again; next turn: the same
    image, the answer and a new question, as an agent's next turn sends them) medians."""
    def body(picture: Image.Image, *after: dict[str, str]) -> dict[str, object]:
        return {"max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(picture)}}, {"type": "text", "text": QUESTION}]},
            *after]}

    with serve_subprocess(["--model", str(path)], {}, BENCH_DIR / f"{path.name}.log") as served, \
            httpx.Client(base_url=served, timeout=600) as client:
        client.post("/v1/chat/completions", json=body(image)).raise_for_status()  # warm
        cold, cached, turn = [], [], []
        for round_ in range(rounds):
            pixels = np.array(image)
            pixels[0, 0] = (round_ * 37 + 1) % 256  # another image (the warm one's pixel is 0): its features computed
            picture = Image.fromarray(pixels)
            after = ({"role": "assistant", "content": "A window with lines of text."},
                     {"role": "user", "content": "What does the second line say?"})
            # Encoded before the clock starts: a client holds its screenshot's PNG (mlx-vlm is given a file).
            for seconds, payload in ((cold, body(picture)), (cached, body(picture)), (turn, body(picture, *after))):
                start = time.perf_counter()
                client.post("/v1/chat/completions", json=payload).raise_for_status()
                seconds.append(time.perf_counter() - start)
    return median(cold), median(cached), median(turn)


def throughput(path: Path, image: Image.Image, requests: int, tokens: int) -> tuple[float, float]:
    """Generated tokens/s over *requests* image requests (each another image, *tokens* tokens each), one after
    another and all at once."""
    import concurrent.futures

    def body(index: int, run: int) -> dict[str, object]:
        pixels = np.array(image)
        pixels[1, 1] = (index * 31 + run * 7) % 256  # another image each time: its features computed
        return {"max_tokens": tokens, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(Image.fromarray(pixels))}},
            {"type": "text", "text": QUESTION}]}]}

    with serve_subprocess(["--model", str(path), "--parallel", str(requests)], {},
                          BENCH_DIR / f"{path.name}-throughput.log") as served, \
            httpx.Client(base_url=served, timeout=600, limits=httpx.Limits(max_connections=requests)) as client:
        def ask(index: int, run: int) -> int:
            answer = client.post("/v1/chat/completions", json=body(index, run))
            answer.raise_for_status()
            return int(answer.json()["usage"]["completion_tokens"])

        ask(99, 0)  # warm
        start = time.perf_counter()
        made = sum(ask(index, 1) for index in range(requests))
        alone = made / (time.perf_counter() - start)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            made = sum(pool.map(lambda index: ask(index, 2), range(requests)))
        together = made / (time.perf_counter() - start)
    return alone, together


def mlx_vlm_server_ttft(path: Path, image: Image.Image, rounds: int) -> tuple[float, float]:
    """(cold, the same image again) medians through ``mlx_vlm.server``'s chat completions, as for mlxcel."""
    from benchmarks._common import mlx_lm_server

    def body(picture: Image.Image) -> dict[str, object]:
        return {"model": str(path), "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(picture)}}, {"type": "text", "text": QUESTION}]}]}

    with mlx_lm_server(path, module="mlx_vlm.server") as served, httpx.Client(base_url=served, timeout=600) as client:
        client.post("/v1/chat/completions", json=body(image)).raise_for_status()  # warm (it loads here)
        cold, cached = [], []
        for round_ in range(rounds):
            pixels = np.array(image)
            pixels[0, 0] = (round_ * 37 + 11) % 256
            payload = body(Image.fromarray(pixels))
            for seconds in (cold, cached):
                start = time.perf_counter()
                client.post("/v1/chat/completions", json=payload).raise_for_status()
                seconds.append(time.perf_counter() - start)
    return median(cold), median(cached)


def interleaved_ttft(path: Path, image: Image.Image, rounds: int) -> tuple[float, float]:
    """(mlxcel cold, mlx-vlm ``generate``) medians, the two sides' rounds taking turns (each round another image
    for both), so that a machine's drift between them falls on both alike."""
    import mlx.core as mx
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    ours, theirs = [], []
    with serve_subprocess(["--model", str(path)], {}, BENCH_DIR / f"{path.name}-interleaved.log") as served, \
            httpx.Client(base_url=served, timeout=600) as client:
        for round_ in range(rounds + 1):  # the first warms both
            pixels = np.array(image)
            pixels[2, 2] = (round_ * 53 + 1) % 256
            picture = Image.fromarray(pixels)
            file = BENCH_DIR / f"screenshot-{round_}.png"
            picture.save(file)
            payload = {"max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _data_url(picture)}}, {"type": "text", "text": QUESTION}]}]}
            start = time.perf_counter()
            client.post("/v1/chat/completions", json=payload).raise_for_status()
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            generate(model, processor, prompt, image=[str(file)], max_tokens=1, verbose=False)
            mx.synchronize()
            theirs.append(time.perf_counter() - start)
    return median(ours[1:]), median(theirs[1:])


def mlx_vlm_ttft(path: Path, image: Image.Image, rounds: int) -> float:
    import mlx.core as mx
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(path))
    file = BENCH_DIR / "screenshot.png"
    image.save(file)
    prompt = apply_chat_template(processor, model.config, QUESTION, num_images=1)
    generate(model, processor, prompt, image=[str(file)], max_tokens=1, verbose=False)  # warm
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        generate(model, processor, prompt, image=[str(file)], max_tokens=1, verbose=False)
        mx.synchronize()
        seconds.append(time.perf_counter() - start)
    return median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", choices=["gemma4", "qwen3_5"], default=["gemma4"])
    parser.add_argument("--size", nargs="+", choices=sorted(SIZES), default=["tiny", "large"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-mlx-vlm", action="store_true", help="measure mlxcel alone")
    parser.add_argument("--mlx-vlm-server", action="store_true", help="also through mlx_vlm.server, over HTTP")
    parser.add_argument("--interleave", action="store_true",
                        help="instead: mlxcel's cold request and mlx-vlm's generate, round by round in turn")
    parser.add_argument("--throughput", type=int, default=0, metavar="N",
                        help="instead: N image requests of 32 tokens, one after another and all at once")
    args = parser.parse_args()
    runs = [(family, size) for family in args.family for size in args.size
            if family == "gemma4" or size in QWEN_SIZES]
    if args.throughput:
        for family, size in runs:
            alone, together = throughput(checkpoint(size, family), screenshot(), args.throughput, 32)
            print(f"{family} {size}: {args.throughput} image requests of 32 tokens, one after another "
                  f"{alone:.1f} tokens/s, all at once {together:.1f} tokens/s ({together / alone:.2f}x)")
        return
    image = screenshot()
    if args.interleave:
        for family, size in runs:
            ours, theirs = interleaved_ttft(checkpoint(size, family), image, args.rounds)
            print(f"{family} {size}: in turn, mlxcel cold {ours * 1000:.0f} ms, mlx-vlm generate "
                  f"{theirs * 1000:.0f} ms; mlx-vlm / mlxcel {theirs / ours:.3f}")
        return
    for family, size in runs:
        path = checkpoint(size, family)
        cold, cached, turn = mlxcel_ttft(path, image, args.rounds)
        theirs = mlx_vlm_ttft(path, image, args.rounds) if not args.no_mlx_vlm else float("nan")
        weights = sum(f.stat().st_size for f in path.glob("model*.safetensors")) / 1e9
        print(f"{family} {size} ({weights:.2f} GB): mlxcel cold {cold * 1000:.0f} ms, the same image again "
              f"{cached * 1000:.0f} ms, the next turn resending it {turn * 1000:.0f} ms ({turn / cold:.1%} of "
              f"cold); mlx-vlm generate {theirs * 1000:.0f} ms; mlx-vlm / mlxcel: cold {theirs / cold:.2f}, "
              f"again {theirs / cached:.2f}")
        if args.mlx_vlm_server:
            server_cold, server_again = mlx_vlm_server_ttft(path, image, args.rounds)
            print(f"{family} {size}: mlx_vlm.server cold {server_cold * 1000:.0f} ms, the same image again "
                  f"{server_again * 1000:.0f} ms; mlx_vlm.server / mlxcel: cold {server_cold / cold:.2f}, "
                  f"again {server_again / cached:.2f}")


if __name__ == "__main__":
    main()
