"""``--served-model-name``: which names a request may use, on every generation route, and what it is answered with."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import refused, running_server


async def test_served_names_the_directory_and_default_are_accepted_and_the_first_is_the_models(
        hello_model: Path) -> None:
    argv = ["--model", str(hello_model), "--served-model-name", "coder", "--served-model-name", "coder-alias"]
    async with running_server(argv) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["coder"]
        for name in ("coder", "coder-alias", hello_model.name, "default"):
            chat = await client.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert (chat.status_code, chat.json()["model"]) == (200, "coder"), name
            assert (await client.get(f"/v1/models/{name}")).status_code == (404 if name == "default" else 200)
        responses = await client.post("/v1/responses", json={"model": "coder-alias", "input": "hi",
                                                              "max_output_tokens": 2})
        assert (responses.status_code, responses.json()["model"]) == (200, "coder")
        messages = await client.post("/v1/messages", json={"model": "claude-haiku-4-5", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 200
        unknown = {
            "/v1/completions": {"model": "gpt-4o", "prompt": "hi", "max_tokens": 2},
            "/v1/responses": {"model": "gpt-4o", "input": "hi"},
            "/v1/messages": {"model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        }
        answers = {path: await client.post(path, json=body) for path, body in unknown.items()}
    assert {path: a.status_code for path, a in answers.items()} == dict.fromkeys(unknown, 404)
    assert answers["/v1/completions"].json()["error"]["code"] == "model_not_found"
    assert answers["/v1/messages"].json()["error"]["type"] == "not_found_error"


def test_a_served_name_with_a_space_is_refused_before_anything_starts(hello_model: Path) -> None:
    stderr = refused("--model", str(hello_model), "--served-model-name", "two words")
    assert "--served-model-name must be 1 to 256 printable characters without spaces" in stderr
