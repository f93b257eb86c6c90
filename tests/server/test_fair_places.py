"""The batch's places are shared fairly: a request's ``n`` choices cannot keep a later request behind them all.

From outside, over real HTTP: a streamed ``n=6`` request on two places, then a
short request of another client. Under first-come-first-served the short one
would wait until choices 2 and 3 had finished too; with the fewest-places rule
alone, until choice 0 or 1 had; with the overflow place (a request holding
none is not kept behind another's extra choices) it starts at once, and is
done before choices 0 and 1 are half way.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from tests.server.conftest import running_server

CHOICE_TOKENS = 120


async def test_a_later_request_takes_the_first_free_place_ahead_of_waiting_choices(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--parallel", "2"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client:
        tokens: dict[int, int] = {}  # choice index -> tokens streamed so far
        first_token = trio.Event()
        seen_at_short_done: dict[int, int] = {}

        async def many() -> None:
            body = {"prompt": "def wrap(text, width=70):", "max_tokens": CHOICE_TOKENS, "n": 6, "stream": True,
                    "temperature": 1.0, "seed": 7}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("text"):
                            tokens[choice["index"]] = tokens.get(choice["index"], 0) + 1
                            first_token.set()

        async def short() -> None:
            await first_token.wait()  # choices 0 and 1 hold both places; 2-5 wait
            answer = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200
            seen_at_short_done.update(tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(many)
            nursery.start_soon(short)
    assert set(tokens) == set(range(6))  # every choice decoded in the end
    # First come first served would have decoded choices 2 and 3 (all their tokens) first.
    assert seen_at_short_done.get(3, 0) < CHOICE_TOKENS // 4, seen_at_short_done
    assert max(seen_at_short_done.get(0, 0), seen_at_short_done.get(1, 0)) < CHOICE_TOKENS // 2, seen_at_short_done
