"""Nothing waits on a long prompt, and nothing is generated for a client that has gone."""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from mlxcel.engine import GenerationRequest
from mlxcel.engine.instrument import Hooks
from tests.server.conftest import running_server

LONG_PROMPT = [(37 * i) % 500 + 3 for i in range(2000)]  # token ids: four prefill chunks of 512
PROMPT = "for line in lines:"


async def _text(client: httpx.AsyncClient, url: str, prompt: object, max_tokens: int) -> str:
    response = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


@pytest.mark.slow
async def test_a_long_prefill_sees_a_new_request_within_one_chunk(llama: Path) -> None:
    second_sent = threading.Event()
    prefill_chunks: dict[int, int] = {}

    def hook(point: str, request: GenerationRequest) -> None:
        if point != "prefill":
            return
        prefill_chunks[request.max_tokens] = prefill_chunks.get(request.max_tokens, 0) + 1
        if request.max_tokens == 11 and prefill_chunks[11] == 1:
            second_sent.wait(10)
            time.sleep(0.2)  # the worker thread, not the event loop: the second request reaches the inbox

    async with running_server(["--model", str(llama), "--parallel", "2", "--prompt-cache-size", "0"],
                              instrument=Hooks(at=hook)) as url, httpx.AsyncClient(timeout=60) as client:
        alone = await _text(client, url, LONG_PROMPT, 12)
        assert prefill_chunks == {12: 4}  # alone, the prompt goes through in four chunks
        texts: dict[str, str] = {}

        async def run(name: str, prompt: object, max_tokens: int) -> None:
            texts[name] = await _text(client, url, prompt, max_tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", LONG_PROMPT, 11)
            await trio.sleep(0.1)
            nursery.start_soon(run, "short", PROMPT, 8)
            await trio.sleep(0.05)
            second_sent.set()
    # After its first chunk the long prompt went into the batch with the new request; the batch
    # prefilled the rest. Its text is what it was alone.
    assert prefill_chunks[11] == 1
    assert texts["long"] == alone[:len(texts["long"])] and texts["short"]


@pytest.mark.slow
async def test_requests_dropped_right_after_sending_generate_nothing_for_nobody(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--metrics", "--slots", "--parallel", "4",
                               "--max-queue-depth", "4"]) as url, httpx.AsyncClient(timeout=60) as client:
        await _text(client, url, PROMPT, 4)
        for _ in range(16):  # sent and closed at once, before any answer: as a client that gives up
            stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            body = (f'{{"prompt": "{PROMPT}", "max_tokens": 3000, "temperature": 0, "stream": true}}').encode()
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await stream.aclose()
        with trio.fail_after(30):
            while any(slot["is_processing"] for slot in (await client.get(f"{url}/slots")).json()):
                await trio.sleep(0.05)
        metrics = (await client.get(f"{url}/metrics")).text
        generated = float(re.search(r"^mlxcel_generated_tokens_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
        # Each dropped request may decode a few steps before its cancel is seen; none runs to its 3000.
        assert generated < 4 + 16 * 300, generated
        assert await _text(client, url, PROMPT, 4)


@pytest.mark.slow
async def test_a_long_prompt_s_scores_take_turns_with_the_other_streams(llama: Path) -> None:
    """``echo`` with ``logprobs`` scores its prompt a chunk per turn, the batch stepping between the chunks:
    a stream beside it is never paused for the whole prompt. The scores are those the request gets alone."""
    points: list[tuple[str, int]] = []

    def hook(point: str, request: GenerationRequest) -> None:
        points.append((point, request.max_tokens))
        if request.max_tokens == 300 and point in ("solo_step", "batch_step"):
            time.sleep(0.01)  # the stream outlasts the echo's arrival and scores, however busy the machine

    echo = {"prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    async with running_server(["--model", str(llama), "--prompt-cache-size", "0"], instrument=Hooks(at=hook)) \
            as url, httpx.AsyncClient(timeout=60) as client:
        alone = (await client.post(f"{url}/v1/completions", json=echo)).json()["choices"][0]
        chunks = -(-(len(LONG_PROMPT) - 1) // 128)  # a chunk of 128 positions per turn
        assert [p for p, _ in points].count("score") == chunks
        points.clear()
        answers: list[httpx.Response] = []

        async def post_echo() -> None:
            answers.append(await client.post(f"{url}/v1/completions", json=echo))

        async with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True,
                "logit_bias": {"2": -100}}) as stream, trio.open_nursery() as nursery:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if line.startswith("data: {") and not nursery.child_tasks and not answers:
                    nursery.start_soon(post_echo)  # the stream is decoding: the echo comes beside it
    beside = answers[0].json()["choices"][0]
    assert beside["logprobs"] == alone["logprobs"] and beside["text"] == alone["text"]
    scored = [i for i, (point, max_tokens) in enumerate(points) if point == "score" and max_tokens == 3]
    assert len(scored) == chunks
    # Between any two chunks of the prompt's scores, the stream took a step of the batch.
    for before, after in itertools.pairwise(scored):
        assert ("batch_step", 300) in points[before + 1:after], points[before:after + 1]
