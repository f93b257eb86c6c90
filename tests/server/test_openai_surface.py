"""The OpenAI surface against references: shapes, n, logprobs, echo, bias, penalties, min-p, MTP.

Every response here (and in every other server test) is also validated
against OpenAI's OpenAPI schemas by the autouse fixture in ``conftest.py``.
References are mlx-lm's own: its ``generate_step`` with its logits
processors, and the model's forward pass.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests import openai_spec
from tests.server.conftest import running_server
from tests.server.test_logprob_surface import openai_key

PROMPT = "def wrap(text, width=70):"
CHAT = [{"role": "user", "content": "Say something about wrapping text."}]


@functools.cache
def _load(checkpoint: Path) -> tuple[Any, Any]:
    """mlx-lm's own load of *checkpoint*: its model and tokenizer, loaded once for every reference of a module
    (a reference only reads them: each generation makes its own cache)."""
    from mlx_lm import load

    return load(str(checkpoint))


def _reference(checkpoint: Path, prompt: list[int], max_tokens: int, **processors: Any) -> list[int]:
    """mlx-lm's greedy generation with its own logits processors (mlx-lm's keyword names)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = _load(checkpoint)
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  logits_processors=make_logits_processors(**processors)):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def _first_position_top(checkpoint: Path, prompt: list[int], k: int) -> list[tuple[int, float]]:
    """The model's own k most likely next tokens after *prompt*, with their log-probabilities."""
    import mlx.core as mx

    model, _ = _load(checkpoint)
    logits = model(mx.array([prompt]))[0, -1].astype(mx.float32)
    logprobs = (logits - mx.logsumexp(logits)).tolist()
    ranked = sorted(range(len(logprobs)), key=lambda t: -logprobs[t])[:k]
    return [(t, logprobs[t]) for t in ranked]


def _tokenizer(checkpoint: Path) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(checkpoint)


async def _post(client: httpx.AsyncClient, url: str, path: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"{url}{path}", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_the_schema_check_catches_what_the_spec_forbids() -> None:
    good = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "logprobs": None,
         "message": {"role": "assistant", "content": "hi", "refusal": None}}]}
    assert openai_spec.problems("CreateChatCompletionResponse", good) == []
    no_refusal = json.loads(json.dumps(good))
    del no_refusal["choices"][0]["message"]["refusal"]
    assert openai_spec.problems("CreateChatCompletionResponse", no_refusal)
    chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}
    assert openai_spec.problems("CreateCompletionStreamChunk", chunk) == []
    assert openai_spec.problems("CreateCompletionResponse", chunk)  # a body's finish_reason is never null
    assert openai_spec.problems("CreateCompletionStreamChunk", {**chunk, "usage": None})
    old_logprobs = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": None, "text_offset": None}
    chunk["choices"][0]["logprobs"] = old_logprobs
    assert openai_spec.problems("CreateCompletionStreamChunk", chunk)
    events = b'data: {"error": {"message": "m", "type": "t", "param": null}}\n\ndata: [DONE]\n\n'
    assert openai_spec.body_problems("POST", "/v1/completions", 200, "text/event-stream", events)


async def test_shapes_logprobs_models_and_cached_tokens(llama: Path, _openai_spec: list[str]) -> None:
    tokenizer = _tokenizer(llama)
    prompt = tokenizer.encode(PROMPT)
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        listed = (await client.get(f"{url}/v1/models")).json()["data"][0]
        model = (await client.get(f"{url}/v1/models/{listed['id']}")).json()
        config = json.loads((llama / "config.json").read_text())
        assert model == listed and model["max_model_len"] == config["max_position_embeddings"]

        # Completions logprobs = 3: the model's own top 3 at the first position, the chosen token always listed.
        body = await _post(client, url, "/v1/completions", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
        logprobs = body["choices"][0]["logprobs"]
        expected = _first_position_top(llama, prompt, 3)
        first = logprobs["top_logprobs"][0]
        keys = [openai_key(llama, t, tokenizer.decode([t])) for t, _ in expected]
        assert list(first) == keys
        assert all(math.isclose(first[key], v, abs_tol=1e-4) for key, (_, v) in zip(keys, expected, strict=True))
        # 3 + the chosen one when it is not among them; a piece of a character is keyed by its bytes.
        assert all(3 <= len(top) <= 4 and (top.get(piece) == value or "\ufffd" in piece) for top, piece, value in
                   zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"], strict=True))
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(6)]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # Chat: refusal null, top_logprobs sorted, greedy picks the first alternative.
        chats = []
        for _ in range(2):
            chats.append(await _post(client, url, "/v1/chat/completions", messages=CHAT, max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=4))
        choice = chats[0]["choices"][0]
        assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
        for entry in choice["logprobs"]["content"]:
            values = [alt["logprob"] for alt in entry["top_logprobs"]]
            assert len(values) == 4 and values == sorted(values, reverse=True)
            assert entry["top_logprobs"][0]["token"] == entry["token"] and values[0] == entry["logprob"]
        # The second, identical chat reused its prompt from the prefix cache, and says so.
        cached = chats[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached == chats[1]["timings"]["cached_n"] < chats[1]["usage"]["prompt_tokens"]
        assert chats[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # Streamed top logprobs: the same alternatives as the whole body's.
        streamed = await client.post(f"{url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 4,
            "stream": True})
        events = openai_spec.sse_payloads(streamed.content)
        content = [e for event in events for c in event["choices"] if c["logprobs"]
                   for e in c["logprobs"]["content"]]
        assert content == choice["logprobs"]["content"]
    # The autouse fixture really looked at these responses.
    assert {"GET /v1/models 200", "POST /v1/chat/completions 200", "POST /v1/completions 200"} <= set(_openai_spec)
    assert any(c.startswith("GET /v1/models/") for c in _openai_spec)


async def test_n_echo_and_min_p(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        greedy = (await _post(client, url, "/v1/completions", prompt=PROMPT, max_tokens=12,
                              temperature=0))["choices"][0]["text"]
        # n = 3 at temperature 1: three choices, seeded each their own way, reproducible as a whole.
        sampled = [await _post(client, url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=1,
                               seed=11, n=3) for _ in range(2)]
        texts = [c["text"] for c in sampled[0]["choices"]]
        assert [c["index"] for c in sampled[0]["choices"]] == [0, 1, 2]
        assert len(set(texts)) > 1 and texts == [c["text"] for c in sampled[1]["choices"]]
        usage = sampled[0]["usage"]
        assert usage["completion_tokens"] == 36 and usage["total_tokens"] == usage["prompt_tokens"] + 36
        # n greedy choices are the greedy text each.
        both = await _post(client, url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0, n=2)
        assert [c["text"] for c in both["choices"]] == [greedy, greedy]

        # echo: the prompt, then the same completion; streamed too.
        echoed = await _post(client, url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0, echo=True)
        assert echoed["choices"][0]["text"] == PROMPT + greedy
        stream = await client.post(f"{url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "echo": True, "stream": True})
        assert "".join(c["text"] for e in openai_spec.sse_payloads(stream.content)
                       for c in e["choices"]) == PROMPT + greedy

        # min_p = 1 keeps only the most likely token: at temperature 2, the greedy text, seed for seed.
        for seed in (1, 2):
            hot = dict(prompt=PROMPT, max_tokens=12, temperature=2, seed=seed)
            assert (await _post(client, url, "/v1/completions", **hot, min_p=1.0))["choices"][0]["text"] == greedy
        assert (await _post(client, url, "/v1/completions", **hot))["choices"][0]["text"] != greedy


def _n_session(url: str) -> tuple[list[str], list[str], int, int]:
    """n = 2 through the `openai` package, whole and streamed: the texts, and both usages' completion tokens."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert client.models.retrieve(model).id == model
        request: dict[str, Any] = dict(model=model, messages=CHAT, max_tokens=8, temperature=1.0, seed=4, n=2)
        whole = client.chat.completions.create(**request)
        pieces, usage = ["", ""], None
        for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
            for choice in chunk.choices:
                pieces[choice.index] += choice.delta.content or ""
            usage = chunk.usage or usage
        assert whole.usage is not None and usage is not None
        return ([c.message.content or "" for c in whole.choices], pieces, whole.usage.completion_tokens,
                usage.completion_tokens)


async def test_n_streams_through_the_openai_client(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url:
        whole, streamed, whole_tokens, streamed_tokens = await trio.to_thread.run_sync(_n_session, url)
    assert streamed == whole and whole[0] != whole[1] and whole_tokens == streamed_tokens


PROCESSED = [
    # (request parameters, mlx-lm's make_logits_processors keywords)
    ({"presence_penalty": 2.0, "presence_context_size": 64},
     {"presence_penalty": 2.0, "presence_context_size": 64}),
    ({"frequency_penalty": 1.5, "frequency_context_size": 20}, {"frequency_penalty": 1.5}),
    ({"repetition_penalty": 3.0, "repetition_context_size": 30},
     {"repetition_penalty": 3.0, "repetition_context_size": 30}),
]


async def test_bias_and_penalties_decode_as_mlx_lm_with_its_processors(llama: Path) -> None:
    tokenizer = _tokenizer(llama)
    prompt = tokenizer.encode(PROMPT)
    plain = _reference(llama, prompt, 24)
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        async def text(**params: Any) -> str:
            body = await _post(client, url, "/v1/completions", prompt=prompt, max_tokens=24, temperature=0,
                               **params)
            return str(body["choices"][0]["text"])

        # A +100 bias makes a token the greedy choice every time; -100 removes it.
        favourite = plain[0] + 1
        assert await text(logit_bias={str(favourite): 100}) == tokenizer.decode([favourite] * 24)
        banned = await text(logit_bias={str(t): -100 for t in set(plain)})
        assert banned and not set(tokenizer.encode(banned)) & set(plain)
        references = [_reference(llama, prompt, 24, **keywords) for _, keywords in PROCESSED]
        for (params, _), expected in zip(PROCESSED, references, strict=True):
            assert expected != plain, params  # the processor changes this output
            assert await text(**params) == tokenizer.decode(expected), params
        # In the batch too: two requests at once, one with a penalty.
        results: dict[str, str] = {}

        async def run(name: str, **params: Any) -> None:
            results[name] = await text(**params)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run("penalised", **PROCESSED[0][0]))
            nursery.start_soon(lambda: run("plain"))
        assert results == {"penalised": tokenizer.decode(references[0]),
                           "plain": tokenizer.decode(plain)}


def _openai_penalised(checkpoint: Path, prompt: list[int], max_tokens: int, presence: float,
                      frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's formula written out here, in numpy over Python counts (not mlxcel's code):
    ``logit[j] -= c[j] * frequency + (c[j] > 0) * presence``, c counting the tokens generated so far."""
    from collections import Counter

    import mlx.core as mx
    import numpy as np

    model, tokenizer = _load(checkpoint)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = np.array(model(mx.array([prompt + out]))[0, -1].astype(mx.float32))
        for token, count in Counter(out).items():
            logits[token] -= count * frequency + presence
        token = int(np.argmax(logits))
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


async def test_presence_and_frequency_penalties_count_the_whole_completion_as_openai(llama: Path) -> None:
    """Unset context sizes mean OpenAI's penalties: every generated token counts, however far back, and the
    prompt does not; mlx-lm's 20-token window (prompt included) is what naming a context size asks for."""
    tokenizer = _tokenizer(llama)
    prompt = tokenizer.encode(PROMPT)
    expected = _openai_penalised(llama, prompt, 48, presence=0.4, frequency=0.3)
    windowed = _reference(llama, prompt, 48, presence_penalty=0.4, frequency_penalty=0.3)
    assert expected != windowed  # the two meanings part on this model
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        for stream_choices in (1, 2):  # alone, and batched beside another choice
            body = await _post(client, url, "/v1/completions", prompt=prompt, max_tokens=48, temperature=0,
                               presence_penalty=0.4, frequency_penalty=0.3, n=stream_choices)
            assert body["choices"][0]["text"] == tokenizer.decode(expected)
        body = await _post(client, url, "/v1/completions", prompt=prompt, max_tokens=48, temperature=0,
                           presence_penalty=0.4, frequency_penalty=0.3, presence_context_size=20,
                           frequency_context_size=20)
        assert body["choices"][0]["text"] == tokenizer.decode(windowed)


MTP_PROCESSED = [
    # (request parameters, mlx-lm's keywords): each changes the MTP target's 48 tokens (a presence or a
    # frequency penalty alone does not; the repetition penalty, alone or chained with all the others, does).
    ({"logit_bias": {"7": 5}}, {"logit_bias": {7: 5}}),
    PROCESSED[2],
    ({"repetition_penalty": 3.0, "repetition_context_size": 30, "presence_penalty": 2.0, "frequency_penalty": 2.0,
      "presence_context_size": 20, "frequency_context_size": 20, "logit_bias": {"9": -3}},
     {"repetition_penalty": 3.0, "repetition_context_size": 30, "presence_penalty": 2.0, "frequency_penalty": 2.0,
      "logit_bias": {9: -3}}),
]


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


async def test_processors_run_in_the_mtp_burst_and_decode_as_mlx_lm(mtp_target: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias or a penalty no longer keeps a request out of the burst, and its text is mlx-lm's own."""
    tokenizer = _tokenizer(mtp_target)
    prompt = tokenizer.encode(PROMPT)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")  # the policy forced on: every eligible request bursts
    async with running_server(["--model", str(mtp_target), "--mtp"]) as url, \
            httpx.AsyncClient(timeout=120) as client:
        async def completion(**params: Any) -> dict[str, Any]:
            return await _post(client, url, "/v1/completions", prompt=prompt, max_tokens=48, **params)

        assert (await completion(temperature=0))["timings"]["draft_rounds"] > 0
        # min-p is part of the sampling chain the burst's acceptance rule uses: it bursts too.
        assert (await completion(temperature=0.8, min_p=0.1, seed=1))["timings"]["draft_rounds"] > 0
        plain = _reference(mtp_target, prompt, 48)
        for params, keywords in MTP_PROCESSED:
            expected = _reference(mtp_target, prompt, 48, **keywords)
            assert expected != plain, params  # the processor changes this output
            body = await completion(temperature=0, **params)
            assert body["timings"]["draft_rounds"] > 0, params
            assert body["choices"][0]["text"] == tokenizer.decode(expected), params
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        assert policy["mtp_enabled"] is True
