"""Grammars are compiled before a request reaches the engine: never on the worker, never stalling a stream.

llguidance is real here. The spy around its matcher's constructor
(``LLMatcher``, the per-request compile) records the thread it runs on and
adds :data:`COMPILE_SECONDS`, what a large schema over a large vocabulary
can cost: run on the worker, that would be a hole that long in every other
stream. llguidance's tokenizer (which holds the GIL while it walks the
vocabulary) is built once, at load, before the server is ready.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import llguidance
import llguidance.hf
import pytest
import trio

from mlxcel.engine.instrument import Hooks
from tests.server.conftest import running_server

COMPILE_SECONDS = 0.75
"""What the spy adds to each constructor: a compile this long on the worker stalls every sequence."""
STREAM_TOKENS = 200
"""max_tokens of the long stream (its steps are slowed, so it outlasts the grammar request)."""
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
POINT = {"type": "object", "properties": {"x": DIGIT, "y": DIGIT},
         "required": ["x", "y"], "additionalProperties": False}
AS_POINT = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}


class _Spy:
    """Calls the real llguidance class after *before* (the GIL is free meanwhile, as in llguidance's compile)."""

    def __init__(self, real: Any, before: Callable[[], object]) -> None:
        self.real, self.before = real, before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        return self.real(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # static methods (grammar_from_json_schema, validate_grammar)
        return getattr(self.real, name)


async def test_a_grammar_request_compiles_off_the_worker_and_never_stalls_a_stream(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles: list[int] = []
    worker: set[int] = set()
    tokenizers: list[float] = []
    monkeypatch.setattr(llguidance, "LLMatcher", _Spy(llguidance.LLMatcher, lambda: (
        compiles.append(threading.get_ident()), time.sleep(COMPILE_SECONDS))))  # noting the thread, then slow
    real_from_tokenizer = llguidance.hf.from_tokenizer

    def from_tokenizer(*args: Any, **kwargs: Any) -> Any:
        tokenizers.append(time.perf_counter())
        return real_from_tokenizer(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", from_tokenizer)

    def on_worker(point: str, request: Any) -> None:
        worker.add(threading.get_ident())
        if request.max_tokens == STREAM_TOKENS and point in ("solo_step", "batch_step"):
            time.sleep(0.01)  # the long stream lasts seconds, solo and batched

    async with running_server(["--model", str(llama)], instrument=Hooks(at=on_worker)) as url, \
            httpx.AsyncClient(timeout=60) as client:
        ready = time.perf_counter()
        assert len(tokenizers) == 1 and tokenizers[0] < ready  # llguidance's tokenizer: at load, once
        arrivals: list[float] = []
        results: dict[str, Any] = {}

        async def constrained() -> None:
            results["point"] = await client.post(f"{url}/v1/completions", json={
                "prompt": "point:", "max_tokens": 30, "temperature": 0, "response_format": AS_POINT})

        async with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": "def wrap(text, width=70):", "max_tokens": STREAM_TOKENS, "temperature": 0,
                "stream": True, "logit_bias": {"2": -100}}) as response, trio.open_nursery() as nursery:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 5:
                        nursery.start_soon(constrained)
        assert "point" in results, "the stream ended before the grammar request was sent"
        point = results["point"]
        assert point.status_code == 200, point.text
        jsonschema.validate(json.loads(point.json()["choices"][0]["text"]), POINT)
        # The matcher was compiled on a thread that is not the worker.
        assert len(compiles) == 1 and worker and not set(compiles) & worker
        # The stream went on through the slow compile: no gap anywhere near it.
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert len(arrivals) > 40 and max(gaps) < COMPILE_SECONDS * 0.6, max(gaps)

        # A schema llguidance cannot compile is a 400 before admission; the server serves on.
        dangling = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
        refused = await client.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": dangling}}})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
        again = await client.post(f"{url}/v1/completions", json={"prompt": "point:", "max_tokens": 30,
                                                                 "temperature": 0, "response_format": AS_POINT})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == point.json()["choices"][0]["text"]
        assert len(compiles) == 2 and len(tokenizers) == 1  # each request compiles its matcher; one tokenizer


@pytest.mark.slow
async def test_a_stop_answers_requests_still_compiling_at_once_and_the_process_waits_for_their_compiles(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's SIGTERM during 20 large schemas: 12 requests got no answer (the graceful deadline cut them
    while they waited on compiles), and an ``n=8`` stream ended with "generation ended early". Here the compiles
    hang until the test lets them go: a stop answers every request waiting on one (compiling, or waiting for a
    thread) with a 503 at once, the stream ends with the stop's own message, and the compiles' threads are what
    the process waits for at exit."""
    from mlxcel.serve import run_server
    from mlxcel.server import native
    from mlxcel.server.native import wait_for_native_calls
    from tests.server.conftest import serve_config, wait_ready

    monkeypatch.setattr(native, "NATIVE_THREADS", 2)  # two compiles run, two wait for their turn
    release = threading.Event()
    held: list[int] = []  # the compiles started, each held until *release*
    monkeypatch.setattr(llguidance, "LLMatcher", _Spy(llguidance.LLMatcher, lambda: (
        held.append(threading.get_ident()), release.wait(60))))
    shutdown = trio.Event()
    answers: list[httpx.Response] = []
    events: list[str] = []
    try:
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=60) as client:
            config = serve_config(["--model", str(llama), "--parallel", "8"])
            (url,) = await nursery.start(lambda task_status: run_server(config, shutdown=shutdown,
                                                                        task_status=task_status))
            await wait_ready(url)

            async def constrained() -> None:
                answers.append(await client.post(f"{url}/v1/completions", json={
                    "prompt": "point:", "max_tokens": 30, "response_format": AS_POINT}))

            async with client.stream("POST", f"{url}/v1/completions", json={
                    "prompt": "def wrap(text, width=70):", "max_tokens": 3000, "n": 8, "stream": True,
                    "logit_bias": {"2": -100}}) as stream:
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 1:  # the eight choices decode: now four grammar requests, held compiling
                        for _ in range(4):
                            nursery.start_soon(constrained)
                        with trio.fail_after(30):
                            while len(held) < 2 or native._limiter().statistics().tasks_waiting < 2:
                                await trio.sleep(0.01)
                        assert len(held) == 2  # never more native calls at once than NATIVE_THREADS
                        shutdown.set()
            with trio.fail_after(30):  # answered while every compile still hangs
                while len(answers) < 4:
                    await trio.sleep(0.01)
            assert not release.is_set() and not wait_for_native_calls(timeout=0)
    finally:
        release.set()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"] == "the server is shutting down"
    assert json.loads(events[-1])["error"]["message"] == "server shutting down" and "[DONE]" not in events
    assert wait_for_native_calls(timeout=30)  # the compiles ended once let go: nothing native outlives the server


@pytest.fixture
def sentencepiece_model(llama: Path, tmp_path: Path) -> Path:
    """The tiny llama with transformers' GPTSw3Tokenizer: a Python sentencepiece tokenizer, not a fast one.

    Its file is ``spiece.model``; the same file as ``tokenizer.model`` is what mlxcel's checkpoint check looks for.
    """
    import sentencepiece

    corpus = [line for name in ("textwrap.py", "string.py")
              for line in (Path(sysconfig.get_paths()["stdlib"]) / name).read_text().splitlines() if line.strip()]
    written = io.BytesIO()
    # 511 pieces and the pad: the model's 512 rows (sentencepiece cannot decode an id beyond its pieces).
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=written, vocab_size=511, model_type="bpe", byte_fallback=True,
        unk_id=0, eos_id=1, pad_id=2, bos_id=-1, eos_piece="<|endoftext|>", pad_piece="<pad>", minloglevel=2)
    model = tmp_path / "llama-sentencepiece"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama / name, model / name)
    for name in ("spiece.model", "tokenizer.model"):
        (model / name).write_bytes(written.getvalue())
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTSw3Tokenizer"}))
    return model


async def test_a_grammar_with_a_tokenizer_llguidance_cannot_read_is_a_400(sentencepiece_model: Path) -> None:
    async with running_server(["--model", str(sentencepiece_model)]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        free = await client.post(f"{url}/v1/completions", json={"prompt": "point:", "max_tokens": 4})
        assert free.status_code == 200, free.text
        refused = await client.post(f"{url}/v1/completions", json={
            "prompt": "point:", "max_tokens": 4, "response_format": AS_POINT})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "response_format" and "fast tokenizer" in error["message"]
        assert "GPTSw3Tokenizer" in error["message"]


async def test_a_grammar_serves_a_model_whose_vocabulary_is_wider_than_its_logits(tmp_path: Path) -> None:
    """The tiny Inkling target: 512 tokenizer entries, 500 logits. The ids past the logits are cut off the mask."""
    pytest.importorskip("torch")
    from mlxcel.families.inkling.tiny import build_target

    target = build_target(tmp_path / "inkling-tiny", seed=1)
    pet = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"enum": ["cat", "dog"]}}}
    async with running_server(["--model", str(target)]) as url, httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 10,
                                                                  "temperature": 0, "response_format": pet})
        assert answer.status_code == 200, answer.text
        assert json.loads(answer.json()["choices"][0]["text"]) in ("cat", "dog")
