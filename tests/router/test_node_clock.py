"""The router's clocks, on trio's MockClock: the hung back-off and the health watcher, minutes in milliseconds.

The nodes here are httpx's MockTransport handlers (no sockets), so virtual time
is all the time there is: ``autojump_clock`` jumps to the next timer whenever
every task waits. The real-socket router tests check the same paths end to
end with short real timeouts.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from mlxcel.router.nodes import HUNG_FIRST_SECONDS, HUNG_MAX_SECONDS, Node, watch


async def test_a_hung_node_is_out_of_rotation_a_minute_then_twice_as_long_up_to_an_hour(
        autojump_clock: trio.abc.Clock) -> None:
    node = Node(id="node-0", url="http://node", healthy=True)
    expected = [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0, 3600.0]
    assert (expected[0], expected[-1]) == (HUNG_FIRST_SECONDS, HUNG_MAX_SECONDS)
    for seconds in expected:
        node.lose_request("ReadTimeout", timed_out=True)
        node.healthy = True  # its /health answers: the next probe would say so
        assert node.hung and not node.available
        await trio.sleep(seconds - 0.001)
        assert node.hung
        await trio.sleep(0.002)
        assert not node.hung and node.available
    node.mark_served()  # an answered request resets the back-off
    node.mark_hung()
    await trio.sleep(HUNG_FIRST_SECONDS + 0.001)
    assert not node.hung
    assert node.lost == len(expected)


async def test_the_watcher_probes_every_interval_and_brings_a_node_back_when_health_answers(
        autojump_clock: trio.abc.Clock) -> None:
    health_calls: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            health_calls.append(trio.current_time())
            return httpx.Response(503 if len(health_calls) <= 3 else 200, json={"status": "ok"})
        return httpx.Response(404)  # no policy, no load endpoints: health is all this node has

    node = Node(id="node-0", url="http://node")
    first_round = trio.Event()
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client, trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(lambda: watch([node], client, {}, interval=2.0, timeout=5.0, first_round=first_round))
        await first_round.wait()
        assert not node.healthy and node.last_error == "/health answered 503"
        await trio.sleep(5.0)  # rounds at 0, 2, 4: all 503
        assert not node.healthy
        await trio.sleep(2.0)  # the round at 6 s finds it healthy
        assert node.healthy and node.last_error is None
        nursery.cancel_scope.cancel()
    assert [t - start for t in health_calls] == pytest.approx([0.0, 2.0, 4.0, 6.0])


async def test_a_node_counts_as_healthy_only_with_the_policy_it_answered_that_round(
        autojump_clock: trio.abc.Clock) -> None:
    policy_asked, policy_released = trio.Event(), trio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/internal/mtp-policy":
            policy_asked.set()
            await policy_released.wait()
            return httpx.Response(200, json={"schema_version": 1, "state": "unavailable"})
        return httpx.Response(404)

    node = Node(id="node-0", url="http://node")
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client, trio.open_nursery() as nursery:
        nursery.start_soon(node.probe, client, {}, 5.0)
        await policy_asked.wait()
        # /health has answered 200, the policy not yet: what /router/stats and /health show stays as before.
        assert not node.healthy and node.policy.label() == "unreadable"
        policy_released.set()
    assert node.healthy and node.policy.label() == "unavailable"
