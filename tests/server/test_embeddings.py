"""``POST /v1/embeddings`` through real HTTP and the ``openai`` client, against transformers' own output.

One server for the module: a ``--models`` file with three tiny embedding checkpoints built with transformers'
classes (BERT with mean pooling, XLM-R with its CLS token, a Qwen3 decoder with last-token pooling, declared
Matryoshka), and a chat model. The reference is transformers' ``AutoModel`` on each text alone, pooled and
normalized here as sentence-transformers does.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mlxcel.testing.embeddings import build_embedding_checkpoint
from tests.server.conftest import refused, server_on_a_thread

TEXTS = ["def main():", "import os, sys\nprint('hello world')", "a", "The quick brown fox jumps over the lazy dog."]
FAMILIES = {"bert": "bert", "xlmr": "xlm-roberta", "qwen": "qwen3"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mlxcel.testing.tools import build_scripted_checkpoint

    root = tmp_path_factory.mktemp("embeddings")
    built = {name: build_embedding_checkpoint(root / name, family) for name, family in FAMILIES.items()}
    config = json.loads((built["qwen"] / "config.json").read_text())
    (built["qwen"] / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return {**built, "chat": build_scripted_checkpoint(root / "chat", ("Hello", "."))}


@pytest.fixture(scope="module")
def url(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    file = tmp_path_factory.mktemp("embeddings-config") / "models.toml"
    file.write_text("".join(f'[[models]]\npath = "{path}"\nnames = ["{name}"]\n\n' for name, path in models.items()))
    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("embeddings-cache"))}
    with server_on_a_thread(["--models", str(file), "--metrics", "--memory-budget", "4G"], env) as served:
        yield served


def _reference(checkpoint: Path, texts: list[str]) -> np.ndarray:
    """transformers' hidden states for each text alone, pooled as the checkpoint's 1_Pooling says, normalized."""
    import torch
    import transformers

    pooling = json.loads((checkpoint / "1_Pooling" / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModel.from_pretrained(checkpoint).eval()
    vectors = []
    for text in texts:
        with torch.no_grad():
            states = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        if pooling["pooling_mode_cls_token"]:
            vector = states[0]
        elif pooling["pooling_mode_lasttoken"]:
            vector = states[-1]
        else:
            vector = states.mean(dim=0)
        vectors.append(torch.nn.functional.normalize(vector, dim=0).numpy())
    return np.stack(vectors)


def _embed(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_matches_transformers_batched_and_through_the_openai_client(
        url: str, models: dict[str, Path], name: str) -> None:
    reference = _reference(models[name], TEXTS)
    assert float((reference[0] * reference[1]).sum()) < 0.99  # the inputs give different vectors
    got = _vectors(_embed(url, {"model": name, "input": TEXTS}))  # one batch, padded to the longest
    cosines = (got * reference).sum(axis=1)
    assert cosines.min() >= 0.999, cosines
    assert np.abs(got - reference).max() < 1e-4
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        answer = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64 and decodes it
    assert answer.model == name and answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
    assert np.abs(np.array([item.embedding for item in answer.data]) - got).max() < 1e-6


def test_token_ids_base64_and_a_single_string(url: str, models: dict[str, Path]) -> None:
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(models["bert"])(TEXTS[:2])["input_ids"]
    by_text = _vectors(_embed(url, {"model": "bert", "input": TEXTS[:2]}))
    by_ids = _vectors(_embed(url, {"model": "bert", "input": ids}))
    assert np.abs(by_ids - by_text).max() < 1e-6
    single = _vectors(_embed(url, {"model": "bert", "input": ids[0]}))  # one list of ids is one input
    assert single.shape == (1, 64) and np.abs(single[0] - by_text[0]).max() < 1e-6
    packed = _embed(url, {"model": "bert", "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - by_text[0]).max() < 1e-6
    assert packed["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}


def test_dimensions_where_the_model_was_trained_for_them(url: str) -> None:
    full = _vectors(_embed(url, {"model": "qwen", "input": TEXTS}))
    cut = _vectors(_embed(url, {"model": "qwen", "input": TEXTS, "dimensions": 16}))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert cut.shape == (4, 16) and np.abs(cut - expected).max() < 1e-6
    assert _embed(url, {"model": "qwen", "input": "a", "dimensions": 20}).status_code == 400
    refusal = _embed(url, {"model": "bert", "input": "a", "dimensions": 16}).json()["error"]
    assert refusal["code"] == "unsupported_parameter" and "matryoshka" in refusal["message"]
    assert _vectors(_embed(url, {"model": "bert", "input": "a", "dimensions": 64})).shape == (1, 64)


REFUSED = [
    ({"input": ""}, 400, "input"), ({"input": []}, 400, "input"), ({"input": ["a", ""]}, 400, "input"),
    ({"input": [[]]}, 400, "input"), ({"input": [1.5]}, 400, "input"), ({"input": 3}, 400, "input"),
    ({"input": [True]}, 400, "input"), ({"input": [-1]}, 400, "input"), ({"input": [512]}, 400, "input"),
    ({"input": [[1], "a"]}, 400, "input"), ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "word " * 100}, 400, "input"), ({"input": [[5] * 65]}, 400, "input"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions"), ({"input": "a", "dimensions": True}, 400, "dimensions"),
    ({"input": "a", "dimensions": "16"}, 400, "dimensions"), ({"input": "a", "dimensions": 65}, 400, "dimensions"),
    ({"input": "a", "model": "nobody"}, 404, "model"),
]


def test_bad_requests_get_a_clear_4xx_and_the_server_serves_on(url: str) -> None:
    for body, status, param in REFUSED:
        response = _embed(url, {"model": "bert", **body})
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param, body
    listed = _embed(url, {"model": "nobody", "input": "a"}).json()["error"]["message"]
    assert all(name in listed for name in FAMILIES)
    raw = httpx.post(f"{url}/v1/embeddings", content=b'{"model": "bert", "input": ', timeout=30,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert _vectors(_embed(url, {"model": "bert", "input": "still here"})).shape == (1, 64)


def test_chat_and_embedding_models_refuse_each_others_routes(url: str) -> None:
    wrong = _embed(url, {"model": "chat", "input": "a"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_supported"
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": "bert", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]
    messages = httpx.post(f"{url}/v1/messages", timeout=30, json={"model": "bert", "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error"  # Anthropic's shape on its route
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert listed["bert"]["kind"] == "embedding" and listed["chat"]["kind"] == "generation"
    policy = httpx.get(f"{url}/v1/internal/mtp-policy", params={"model": "bert"}, timeout=30).json()
    assert (policy["state"], policy["reason"]) == ("unavailable", "no_mtp_dispatch")


def test_concurrent_requests_each_get_their_own_vectors(url: str) -> None:
    alone = [_vectors(_embed(url, {"model": "xlmr", "input": [text]}))[0] for text in TEXTS]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _vectors(_embed(url, {"model": "xlmr", "input": TEXTS[i % 4:] * 2})),
                                range(16)))
    for i, got in enumerate(answers):
        assert np.abs(got - np.stack(alone[i % 4:] * 2)).max() < 1e-5


def test_an_embedding_model_refuses_a_drafter_at_start(models: dict[str, Path]) -> None:
    assert "embedding model" in refused("--model", str(models["bert"]), "--mtp")


def test_one_embedding_model_served_alone_under_its_served_name(models: dict[str, Path], tmp_path: Path) -> None:
    argv = ["--model", str(models["bert"]), "--served-model-name", "text-embedding-3-small"]
    with server_on_a_thread(argv, {"MLXCEL_CACHE_DIR": str(tmp_path)}) as lone, \
            openai.OpenAI(base_url=f"{lone}/v1", api_key="unused", max_retries=0) as client:
        answer = client.embeddings.create(model="text-embedding-3-small", input="def main():")
        assert answer.model == "text-embedding-3-small" and len(answer.data[0].embedding) == 64
        assert httpx.get(f"{lone}/health", timeout=30).json()["status"] == "ok"


def test_metrics_say_what_is_loaded_what_each_holds_and_what_is_free(url: str) -> None:
    assert _embed(url, {"model": "qwen", "input": "a"}).status_code == 200
    assert _embed(url, {"model": "bert", "input": "a"}).status_code == 200  # bert: the default model
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'mlxcel_requests_total{route="/v1/embeddings",status="200"}' in text  # the default model's own
    assert 'mlxcel_model_loaded{model="qwen"} 1.0' in text and 'mlxcel_model_loaded{model="chat"}' in text
    assert "mlxcel_memory_budget_bytes 4.294967296e+09" in text
    charged = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("mlxcel_model_charged_bytes{")}
    listed = {m["id"]: m.get("charged_bytes") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert charged["qwen"] == listed["qwen"] > 0
    free = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("mlxcel_memory_free_bytes"))
    assert free == httpx.get(f"{url}/health", timeout=30).json()["memory"]["free"]
