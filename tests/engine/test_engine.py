"""The engine's trio side against a real worker: the queue bound counts what the worker holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from mlxcel.checkpoints import inspect_checkpoint
from mlxcel.engine import Engine, Finish, GenerationRequest, QueueFull, SamplingParams, WorkerSettings
from mlxcel.observability import Observability
from mlxcel.policy import MtpPolicy, PolicySettings
from mlxcel.testing.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("engine") / "llama-tiny", "llama", scale=2.0)


def _request(name: str, max_tokens: int = 3000) -> GenerationRequest:
    return GenerationRequest(id=name, prompt_tokens=(5, 17, 99, 123), max_tokens=max_tokens,
                             sampling=SamplingParams(temperature=0))


async def test_a_cancelled_request_keeps_its_place_until_the_worker_lets_go(llama: Path) -> None:
    observability = Observability(MtpPolicy(PolicySettings()).snapshot)
    engine = Engine(inspect_checkpoint(llama), WorkerSettings(parallel=1, batch=False), observability,
                    max_queue_depth=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        with trio.fail_after(60):
            await engine.ready.wait()
        engine.submit(_request("a"))
        engine.cancel("a")
        # The worker has not said it let go of "a" yet: there is no place for another request.
        with pytest.raises(QueueFull):
            engine.submit(_request("b", 4))
        with trio.fail_after(30):
            while True:
                try:
                    events = engine.submit(_request("b", 4))
                    break
                except QueueFull:
                    await trio.sleep(0.01)
        received = [event async for event in events]
        assert isinstance(received[-1], Finish) and received[-1].reason in ("length", "stop")
        engine.stop()
