"""Generation through real HTTP: the openai client, streaming, batching, the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests.server.conftest import open_stream, running_server, stream_interrupted

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "    return"]


def _greedy_reference(checkpoint: Path, prompt_tokens: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation, for the same checkpoint and prompt."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(checkpoint))
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt_tokens), model, max_tokens=max_tokens):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
async def test_greedy_output_equals_mlx_lm(checkpoints: dict[str, Path], family: str) -> None:
    checkpoint = checkpoints[family]
    async with running_server(["--model", str(checkpoint)]) as url, httpx.AsyncClient(timeout=60) as client:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tokenizer = load_tokenizer(checkpoint)
        for prompt in PROMPTS[:2]:
            tokens = tokenizer.encode(prompt)
            body = (await client.post(f"{url}/v1/completions", json={
                "prompt": tokens, "max_tokens": 24, "temperature": 0, "logprobs": 1})).json()
            expected = _greedy_reference(checkpoint, tokens, 24)
            assert body["choices"][0]["text"] == tokenizer.decode(expected), family
            assert body["usage"]["completion_tokens"] == len(expected)
            assert all(v <= 0 for v in body["choices"][0]["logprobs"]["token_logprobs"])


def _openai_session(url: str, model: str) -> dict[str, object]:
    """Everything a user of the `openai` package would do, with its synchronous client."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        models = [m.id for m in client.models.list().data]
        completion = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            pieces.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        messages = [{"role": "user", "content": "Say something."}]
        chat = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=10, temperature=0)
        chat_stream = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=10, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    return {"models": models, "completion": completion, "streamed": "".join(pieces), "usage": usage,
            "chat": chat, "chat_streamed": streamed}


async def test_openai_client_completions_and_chat(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url:
        got = await trio.to_thread.run_sync(_openai_session, url, llama.name)
    assert got["models"] == [llama.name]
    completion = got["completion"]
    assert isinstance(completion, openai.types.Completion)
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.choices[0].finish_reason == "length"
    assert got["streamed"] == completion.choices[0].text
    usage = got["usage"]
    assert isinstance(usage, openai.types.CompletionUsage) and usage.completion_tokens == 12
    chat = got["chat"]
    assert isinstance(chat, openai.types.chat.ChatCompletion)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert got["chat_streamed"] == chat.choices[0].message.content


async def test_eight_concurrent_streams_match_their_solo_runs(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--parallel", "8"]) as url, \
            httpx.AsyncClient(timeout=120) as client:
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]

        async def stream(prompt: str) -> str:
            text = ""
            async with client.stream("POST", f"{url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            return text

        solo = [await stream(p) for p in prompts]
        together: dict[int, str] = {}

        async def run(i: int) -> None:
            together[i] = await stream(prompts[i])

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run, i)
        assert [together[i] for i in range(8)] == solo
        assert len(set(solo)) > 1  # different prompts really gave different texts


async def test_hybrid_model_batches_correctly(checkpoints: dict[str, Path]) -> None:
    # Byte for byte: each token's log-probabilities alone and beside the others are the same floats (a row's
    # step does not round with the batch's width or its padding, nor its prompt with the prompts beside it).
    async with running_server(["--model", str(checkpoints["qwen3_5"]), "--parallel", "4"]) as url, \
            httpx.AsyncClient(timeout=120) as client:
        async def ask(prompt: str) -> tuple[str, object]:
            r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                                                  "temperature": 0, "logprobs": 2})
            choice = r.json()["choices"][0]
            return str(choice["text"]), choice["logprobs"]

        solo = [await ask(p) for p in PROMPTS]
        together: dict[int, tuple[str, object]] = {}

        async def run(i: int) -> None:
            together[i] = await ask(PROMPTS[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
        assert [together[i] for i in range(len(PROMPTS))] == solo


async def test_stop_strings_seed_and_prefix_cache(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        async def complete(**body: object) -> dict[str, object]:
            r = await client.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], **body})
            assert r.status_code == 200, r.text
            result: dict[str, object] = r.json()
            return result

        full = (await complete(max_tokens=30, temperature=0))["choices"][0]["text"]  # type: ignore[index]
        stop = full[10:13]
        cut = await complete(max_tokens=30, temperature=0, stop=[stop, "never-appears"])
        choice = cut["choices"][0]  # type: ignore[index]
        assert choice["text"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"

        seeded = [(await complete(max_tokens=20, temperature=1.0, seed=7))["choices"][0]["text"]  # type: ignore[index]
                  for _ in range(2)]
        assert seeded[0] == seeded[1]

        stats = (await client.get(f"{url}/v1/cache/stats")).json()
        assert stats["lookups"] == 4 and stats["hits"] >= 3 and stats["reused_tokens"] > 0


async def test_the_prefix_cache_is_bounded_in_bytes(llama: Path) -> None:
    """Each finished sequence's cache is kept until the entries' bytes pass --prompt-cache-bytes: with a bound
    of about two entries, six distinct prompts leave two, the four others evicted (no bound in entries)."""
    prompts = [f"def function_{i}(x):" + " y = x" * 40 for i in range(6)]

    async def fill(argv: list[str]) -> dict[str, int]:
        async with running_server(["--model", str(llama), *argv]) as url, \
                httpx.AsyncClient(timeout=60) as client:
            for prompt in prompts:
                answer = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                                          "temperature": 0})
                assert answer.status_code == 200
            stats: dict[str, int] = (await client.get(f"{url}/v1/cache/stats")).json()
            return stats

    unbounded = await fill([])
    assert (unbounded["entries"], unbounded["evictions"], unbounded["max_entries"]) == (6, 0, None)
    per_entry = unbounded["bytes"] // 6
    bounded = await fill(["--prompt-cache-bytes", str(per_entry * 5 // 2)])
    assert bounded["max_bytes"] == per_entry * 5 // 2
    assert bounded["entries"] == 2 and 0 < bounded["bytes"] <= bounded["max_bytes"], bounded
    assert bounded["evictions"] == 4 and bounded["snapshots"] == 0  # a llama's KV cache rewinds: no snapshots


async def test_disconnect_frees_the_slot(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--parallel", "1", "--slots"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        stream = await open_stream(url, "/v1/completions", {
            "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True, "temperature": 0})
        slots = (await client.get(f"{url}/slots")).json()
        assert slots[0]["is_processing"] is True
        await stream.aclose()  # the client goes away mid-generation
        with trio.fail_after(10):
            while (await client.get(f"{url}/slots")).json()[0]["is_processing"]:
                await trio.sleep(0.02)
        after = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert after.status_code == 200


async def test_queue_bound_answers_503(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--parallel", "1", "--max-queue-depth", "0"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        stream = await open_stream(url, "/v1/completions", {
            "prompt": PROMPTS[0], "max_tokens": 3000, "stream": True})
        refused = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        await stream.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
async def test_a_lone_sequence_handed_to_the_batch_mid_stream_keeps_its_text(
        checkpoints: dict[str, Path], family: str) -> None:
    """A request decoding alone parks when a second one arrives and continues in the batch, unchanged."""
    async with running_server(["--model", str(checkpoints[family]), "--parallel", "4", "--metrics"]) as url, \
            httpx.AsyncClient(timeout=120) as client:
        # Long enough to be mid-stream when the second request arrives (it is sent as the first text arrives,
        # and its 30 tokens end long before these 200 do); the handoff counter says it was.
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0}
        alone = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]["text"]

        async def handoffs() -> float:
            from prometheus_client.parser import text_string_to_metric_families

            metrics = (await client.get(f"{url}/metrics")).text
            (family,) = [f for f in text_string_to_metric_families(metrics) if f.name == "mlxcel_solo_handoffs"]
            return float(family.samples[0].value)

        assert await handoffs() == 0
        interrupted, second = await stream_interrupted(client, url, body, lambda: client.post(
            f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0}))
        assert second.status_code == 200
        assert await handoffs() == 1
        assert interrupted == alone


async def _metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families((await client.get(f"{url}/metrics")).text)
    (family,) = [f for f in families if f.name == name]
    return float(family.samples[0].value)


async def test_a_client_that_leaves_at_once_leaves_nothing_decoding(llama: Path) -> None:
    """A client that leaves at once (a Cancel may overtake its Submit): it sends a stream request and leaves.

    Where it leaves decides which path the server takes: before the body is
    read, while the prompt is tokenized, between submission and the first
    event, or mid-stream. The delays sweep those windows (a few milliseconds on
    this machine; a sleep is the only way to place a disconnect in them). In
    every case the sequence must stop within a few tokens, not decode its
    2,500 tokens for nobody while holding the only place.
    """
    from urllib.parse import urlsplit

    async with running_server(["--model", str(llama), "--parallel", "1", "--max-queue-depth", "0", "--slots",
                               "--metrics"]) as url, httpx.AsyncClient(timeout=60) as client:
        parts = urlsplit(url)
        payload = json.dumps({"prompt": PROMPTS[0] * 120, "max_tokens": 2500, "temperature": 0,
                              "stream": True}).encode()
        generated = 0.0
        for step in range(16):
            stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                                  b"application/json\r\nContent-Length: " + str(len(payload)).encode()
                                  + b"\r\n\r\n" + payload)
            await trio.sleep(step * 0.0005)
            await stream.aclose()
            with trio.fail_after(10):  # the place frees: a short request is served, not refused
                while (after := await client.post(f"{url}/v1/completions",
                                                  json={"prompt": "x", "max_tokens": 1})).status_code == 503:
                    await trio.sleep(0.01)
            assert after.status_code == 200, after.text
            now = await _metric(client, url, "mlxcel_generated_tokens")
            assert now - generated <= 50, (step, now - generated)
            generated = now
