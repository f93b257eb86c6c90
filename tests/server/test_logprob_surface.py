"""Log-probabilities beyond the decoded text: chat's token bytes, ``best_of``, and ``echo`` with ``logprobs``.

The references are independent of the server: the vocabulary itself
(GPT-2's byte table, which byte-level BPE entries are spelled in), and the
model's forward pass through mlx-lm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests import openai_spec
from tests.server.conftest import running_server

PROMPT = "def wrap(text, width=70):"
ACCENT = {"type": "json_schema", "json_schema": {"name": "accent", "schema": {"enum": ["é"]}}}
"""A JSON string of one two-byte character, for which the tiny vocabulary has no token of its own."""


def _vocabulary_bytes(checkpoint: Path, text: str) -> list[bytes]:
    """The bytes of *text*'s tokens, read from the vocabulary entries through GPT-2's byte table."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return [bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(t)) for t in ids]


def _chat_accent(url: str) -> Any:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        return client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "An accent?"}], max_tokens=10, temperature=0,
            logprobs=True, top_logprobs=2, response_format=ACCENT)  # type: ignore[call-overload]


async def test_chat_logprob_bytes_are_each_tokens_own(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url:
        answer = await trio.to_thread.run_sync(_chat_accent, url)
    choice = answer.choices[0]
    assert choice.message.content == '"é"'
    content = choice.logprobs.content
    own = [bytes(entry.bytes) for entry in content]
    # "é" is two tokens of one byte each: neither is text alone, together they are its UTF-8.
    assert own == _vocabulary_bytes(llama, '"é"') == [b'"', b"\xc3", b"\xa9", b'"']
    assert b"".join(own) == '"é"'.encode()
    for entry in content:  # the alternatives' bytes too
        assert all(bytes(top.bytes) == top.token.encode() or "\ufffd" in top.token for top in entry.top_logprobs)


async def _complete(client: httpx.AsyncClient, url: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _total(choice: dict[str, Any]) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


async def test_best_of_returns_the_most_likely_candidates(llama: Path) -> None:
    sampled = {"temperature": 1, "seed": 7}
    async with running_server(["--model", str(llama), "--parallel", "4"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        # The same candidates as n = 4 (choice i is seeded seed + i either way), ranked by their own logprobs.
        every = await _complete(client, url, n=4, logprobs=0, **sampled)
        ranked = sorted(every["choices"], key=_total, reverse=True)
        assert len({c["text"] for c in ranked}) > 1
        best = await _complete(client, url, best_of=4, **sampled)
        assert [c["text"] for c in best["choices"]] == [ranked[0]["text"]]
        assert best["choices"][0]["index"] == 0 and best["choices"][0]["logprobs"] is None
        assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]  # all four were generated
        two = await _complete(client, url, best_of=4, n=2, logprobs=1, **sampled)
        assert [c["text"] for c in two["choices"]] == [c["text"] for c in ranked[:2]]
        assert [c["index"] for c in two["choices"]] == [0, 1]
        assert [_total(c) for c in two["choices"]] == [_total(c) for c in ranked[:2]]

        for bad, message in (({"best_of": 1, "n": 2}, "at least n"), ({"best_of": 2, "stream": True}, "stream")):
            refused = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, **bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of", refused.text
            assert message in refused.json()["error"]["message"]


def _prompt_reference(checkpoint: Path, text: str, top: int) -> tuple[list[int], list[float], list[set[str]]]:
    """The prompt's tokens, each one's log-probability after those before it (one forward of the model), and
    the texts of the *top* most likely tokens at each of those positions."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(checkpoint))
    ids = tokenizer.encode(text)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    rows = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    likely = [sorted(range(len(row)), key=lambda t, row=row: -row[t])[:top] for row in rows[:-1]]
    return (ids, [rows[i][t] for i, t in enumerate(ids[1:])],
            [{openai_key(checkpoint, t, tokenizer.decode([t])) for t in best} for best in likely])


def openai_key(checkpoint: Path, token: int, text: str) -> str:
    """A completions ``top_logprobs`` key as OpenAI writes it: the text, or ``bytes:\\x..`` for a token whose
    bytes (from the vocabulary's byte table) are not whole UTF-8."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    raw = bytes(byte_of[c] for c in AutoTokenizer.from_pretrained(checkpoint).convert_ids_to_tokens(token))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


async def test_echo_with_logprobs_scores_the_prompt(llama: Path) -> None:
    ids, expected, most_likely = _prompt_reference(llama, PROMPT, 2)
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        plain = (await _complete(client, url, temperature=0, logprobs=2))["choices"][0]
        echoed = (await _complete(client, url, temperature=0, logprobs=2, echo=True))["choices"][0]
        logprobs = echoed["logprobs"]
        prompt = len(ids)
        assert echoed["text"] == PROMPT + plain["text"]
        assert "".join(logprobs["tokens"][:prompt]) == PROMPT
        # As OpenAI: the first token has nothing before it, so no log-probability and no alternatives.
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(logprobs["token_logprobs"][1:prompt], expected,
                                                                     strict=True))
        # Each position lists the model's two most likely tokens, and the prompt's own (OpenAI's rule).
        for tops, likely, chosen in zip(logprobs["top_logprobs"][1:prompt], most_likely,
                                        logprobs["tokens"][1:prompt], strict=True):
            assert set(tops) == likely | {chosen}  # the prompt is ASCII: its own tokens are text
        # The completion's part is the completion's own, its offsets after the prompt's token texts.
        assert logprobs["tokens"][prompt:] == plain["logprobs"]["tokens"]
        assert logprobs["token_logprobs"][prompt:] == plain["logprobs"]["token_logprobs"]
        assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
        assert logprobs["text_offset"][prompt] == len(PROMPT)

        # Streamed: the echo chunk carries the prompt's logprobs, the rest the completion's; n = 2 both.
        stream = await client.post(f"{url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True, "stream": True,
            "n": 2})
        chunks = [c for e in openai_spec.sse_payloads(stream.content) for c in e["choices"]]
        for index in (0, 1):
            mine = [c["logprobs"] for c in chunks if c["index"] == index and c["logprobs"]]
            assert [t for lp in mine for t in lp["tokens"]] == logprobs["tokens"]
            assert [v for lp in mine for v in lp["token_logprobs"]] == logprobs["token_logprobs"]


async def test_completion_alternatives_that_are_pieces_of_a_character_keep_a_key_each(llama: Path) -> None:
    """Three one-byte tokens, each a piece of a UTF-8 character (their text alone is U+FFFD), pushed to the top
    by a bias: ``logprobs: 3`` gives three keys, each the token's bytes written as OpenAI writes them."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = AutoTokenizer.from_pretrained(llama)
    spelled = bytes_to_unicode()
    pieces = [0xC3, 0xA9, 0xE6]
    ids = [tokenizer.convert_tokens_to_ids(spelled[b]) for b in pieces]
    assert len(set(ids)) == 3 and tokenizer.unk_token_id not in ids
    bias = {str(t): 40 + i for i, t in enumerate(ids)}  # distinct, so the order is known
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        body = await _complete(client, url, max_tokens=3, temperature=0, logprobs=3, logit_bias=bias)
    expected = {f"bytes:\\x{b:02x}" for b in pieces}
    for top in body["choices"][0]["logprobs"]["top_logprobs"]:
        assert set(top) == expected, top
