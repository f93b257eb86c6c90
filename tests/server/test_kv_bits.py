"""``--kv-bits``: the KV cache quantized (mlx-lm's ``QuantizedKVCache``), through a real server.

The oracle for the text is mlx-lm's own ``generate_step`` running on a cache of mlx-lm's quantized layers:
the reference library's decode loop and attention, on the same quantized cache.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.testing.checkpoints import build_checkpoint
from tests.server.conftest import mlxcel, refused, running_server

PROMPT = "def wrap(text, width=70):\n    lines = []\n"


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama whose head dimension is 64: a quantized cache groups a head's vector by 64."""
    return build_checkpoint(tmp_path_factory.mktemp("kv") / "llama-d64", "llama", scale=2.0, hidden_size=128,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def _reference(checkpoint: Path, prompt: str, max_tokens: int, bits: int) -> list[int]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    model, tokenizer = load(str(checkpoint))
    import mlx.core as mx

    ids = mx.array(tokenizer.encode(prompt, add_special_tokens=False))
    cache = [QuantizedKVCache(64, bits) for _ in model.layers]
    out = []
    for token, _ in generate_step(ids, model, prompt_cache=cache, max_tokens=max_tokens, prefill_step_size=512):
        out.append(int(token))
        if out[-1] in tokenizer.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("bits", [8, 4])
async def test_text_is_mlx_lm_decoding_on_the_same_quantized_cache(wide_heads: Path, bits: int) -> None:
    async with running_server(["--model", str(wide_heads), "--kv-bits", str(bits)]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        first = (await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 0})).json()
        again = (await client.post("/v1/completions", json={
            "prompt": PROMPT + "x", "max_tokens": 8, "temperature": 0})).json()
        stats = (await client.get("/v1/cache/stats")).json()
    expected = _reference(wide_heads, PROMPT, 24, bits)
    tokens = first["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == len(expected)
    from transformers import AutoTokenizer

    assert first["choices"][0]["text"] == AutoTokenizer.from_pretrained(wide_heads).decode(expected)
    # The prefix cache keeps (and trims) quantized caches as it does full-precision ones.
    assert again["timings"]["cached_n"] > 0 and stats["hits"] == 1


async def test_a_quantized_cache_holds_a_token_in_about_a_third_of_the_bytes(wide_heads: Path) -> None:
    held = {}
    for bits in (None, 8, 4):
        argv = ["--model", str(wide_heads)] + ([] if bits is None else ["--kv-bits", str(bits)])
        async with running_server(argv) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            await client.post("/v1/completions", json={"prompt": PROMPT * 20, "max_tokens": 1, "temperature": 0})
            held[bits] = (await client.get("/v1/cache/stats")).json()["bytes"]
    # float32 values; 8 bits plus a float32 scale and bias per 64 values is 9/32 of them, 4 bits 5/32.
    assert held[8] / held[None] == pytest.approx(9 / 32, rel=0.02), held
    assert held[4] / held[None] == pytest.approx(5 / 32, rel=0.02), held


async def test_the_mtp_burst_on_a_quantized_cache_changes_no_text(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 0 with the burst on and off under the same --kv-bits: one text, the burst having run (or
    the exactness probe having said why it cannot)."""
    model = build_mtp_checkpoint(tmp_path / "qwen35-d64", drafter="aligned", context_scale=0.05, head_dim=64)
    texts, timings = {}, {}
    for mtp in ("0", "1"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", mtp)
        async with running_server(["--model", str(model), "--mtp", "--kv-bits", "8",
                                   "--prompt-cache-size", "0"]) as url, \
                httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = (await client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 40, "temperature": 0})).json()
            policy = (await client.get("/v1/internal/mtp-policy")).json()
        texts[mtp], timings[mtp] = body["choices"][0]["text"], body["timings"]
    assert texts["0"] == texts["1"]
    assert timings["0"]["draft_n"] == 0
    assert timings["1"]["draft_n"] > 0 or policy["state"] == "exactness_declined", (timings, policy)


def test_a_model_that_cannot_run_on_a_quantized_cache_stops_with_one_line(checkpoints: dict[str, Path]) -> None:
    done = mlxcel("serve", "--model", str(checkpoints["llama"]), "--port", "0", "--kv-bits", "8", timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxcel serve: stopped: --kv-bits 8: llama-tiny cannot run on a quantized KV cache"), last


def test_kv_bits_with_distributed_is_refused(checkpoints: dict[str, Path]) -> None:
    stderr = refused("--model", str(checkpoints["llama"]), "--kv-bits", "4", "--distributed", "tensor")
    assert stderr.strip().splitlines()[-1] == (
        "mlxcel serve: --kv-bits is not supported with --distributed (the other ranks keep full-precision caches)")
