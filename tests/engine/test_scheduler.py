"""The scheduler's rules, without a model: each test is the rule it names, in milliseconds.

The oracle is the rule as the module docstring states it, written out by hand
for each case (which request goes where, which ends how), never the scheduler's
own output fed back.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mlxcel.engine.messages import Cancel, Stop, Submit
from mlxcel.engine.requests import GenerationRequest
from mlxcel.engine.scheduler import BatchTurn, Capabilities, Idle, Scheduler, ScoreTurn, SoloTurn, burst_allowed

BATCH4 = Capabilities(parallel=4, no_batch=None)
ONE_SLOT = Capabilities(parallel=1, no_batch="--no-batch")


def request(name: str, group: str = "", **fields: object) -> GenerationRequest:
    return GenerationRequest(id=name, prompt_tokens=(1, 2, 3), max_tokens=8, group=group, **fields)  # type: ignore[arg-type]


def submit(*names: str, group: str = "") -> list[Submit]:
    return [Submit(request(name, group)) for name in names]


def test_a_request_alone_decodes_solo() -> None:
    scheduler = Scheduler(BATCH4)
    intake = scheduler.take(submit("a"))
    assert [(r.id, place) for r, place in intake.admitted] == [("a", "solo")]
    assert scheduler.turn() == SoloTurn("a")


def test_two_in_one_drain_both_wait_for_the_batch_and_get_places() -> None:
    scheduler = Scheduler(BATCH4)
    intake = scheduler.take(submit("a", "b"))
    assert [place for _, place in intake.admitted] == ["waiting", "waiting"]
    assert scheduler.turn() == BatchTurn(("a", "b"))
    assert scheduler.turn() == BatchTurn(())  # in their places: the next turns only step


def test_a_second_request_moves_the_solo_one_into_the_batch() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a"))
    assert scheduler.turn() == SoloTurn("a")
    intake = scheduler.take(submit("b"))
    assert intake.to_batch == ["a"]
    assert [(r.id, place) for r, place in intake.admitted] == [("b", "waiting")]
    assert scheduler.turn() == BatchTurn(("b",))
    scheduler.ended("b")
    assert scheduler.turn() == BatchTurn(())  # "a" stays in the batch: once batched, never solo again


def test_after_the_batch_empties_a_new_lone_request_is_solo_again() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a", "b"))
    scheduler.turn()
    scheduler.ended("a")
    scheduler.ended("b")
    assert scheduler.turn() == Idle()
    scheduler.take(submit("c"))
    assert scheduler.turn() == SoloTurn("c")


def test_with_one_slot_everything_is_solo_oldest_first_to_its_end() -> None:
    scheduler = Scheduler(ONE_SLOT)
    scheduler.take(submit("a"))
    intake = scheduler.take(submit("b", "c"))
    assert intake.to_batch == []
    assert [place for _, place in intake.admitted] == ["solo", "solo"]
    assert scheduler.turn() == SoloTurn("a")
    assert scheduler.turn() == SoloTurn("a")  # a turn never moves on while "a" is held
    scheduler.ended("a")
    assert scheduler.turn() == SoloTurn("b")


def test_places_beyond_parallel_wait_and_fill_as_places_free() -> None:
    scheduler = Scheduler(Capabilities(parallel=2, no_batch=None))
    scheduler.take(submit("a", "b", "c"))
    assert scheduler.turn() == BatchTurn(("a", "b"))
    assert scheduler.turn() == BatchTurn(())
    scheduler.ended("b")
    assert scheduler.turn() == BatchTurn(("c",))


def test_the_choices_of_one_request_cannot_keep_a_later_request_behind_all_of_them() -> None:
    # n=16 on 4 places, then two requests of their own. The first takes the overflow place at once; the
    # second takes the first place to free (the overflow one, when the short request ends), ahead of the
    # 12 choices still waiting (which arrived first).
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit(*(f"n-{i}" for i in range(16)), group="n"))
    assert scheduler.turn() == BatchTurn(("n-0", "n-1", "n-2", "n-3"))
    scheduler.take(submit("late", "later"))
    assert scheduler.turn() == BatchTurn(("late",))  # 5 in the batch: one overflow place, no more
    assert scheduler.turn() == BatchTurn(())
    scheduler.ended("late")
    assert scheduler.turn() == BatchTurn(("later",))
    scheduler.ended("later")
    scheduler.ended("n-0")
    assert scheduler.turn() == BatchTurn(("n-4",))  # then the choices, in their order, on the 4 places
    scheduler.ended("n-1")
    assert scheduler.turn() == BatchTurn(("n-5",))


def test_the_overflow_place_is_only_for_a_request_kept_behind_another_s_extra_choices() -> None:
    # Four requests of one place each fill the batch: a fifth waits (every request holds only its own).
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a", "b", "c", "d"))
    assert scheduler.turn() == BatchTurn(("a", "b", "c", "d"))
    scheduler.take(submit("e"))
    assert scheduler.turn() == BatchTurn(())
    # n=2 beside two singles: full, and n holds two; a newcomer overflows, n's own waiting choice does not.
    scheduler = Scheduler(BATCH4)
    scheduler.take([*submit("n-0", "n-1", "n-2", group="n"), *submit("a", "b")])
    assert scheduler.turn() == BatchTurn(("n-0", "a", "b", "n-1"))
    assert scheduler.turn() == BatchTurn(())  # n-2 waits: its request already holds places
    scheduler.take(submit("c"))
    assert scheduler.turn() == BatchTurn(("c",))


def test_free_places_go_to_the_request_holding_fewest_then_the_oldest() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take([*submit("x-0", "x-1", "x-2", group="x"), *submit("y-0", "y-1", group="y"), *submit("z")])
    # Fewest places first, ties to the oldest: x, y, z (0 each), then x-1 (x and y hold 1, x arrived first).
    assert scheduler.turn() == BatchTurn(("x-0", "y-0", "z", "x-1"))
    scheduler.ended("z")
    scheduler.ended("x-0")
    # x holds 1 (x-1) and y holds 1 (y-0): a tie, so the older x-2 first; then x holds 2, y 1: y-1.
    assert scheduler.turn() == BatchTurn(("x-2", "y-1"))


def test_a_cancel_in_the_same_drain_as_its_submit_is_never_admitted() -> None:
    scheduler = Scheduler(BATCH4)
    intake = scheduler.take([*submit("a"), Cancel("a")])
    assert intake.admitted == []
    ((name, finish),) = intake.finished
    assert (name, finish.reason, finish.completion_tokens) == ("a", "cancelled", 0)
    assert scheduler.turn() == Idle()


def test_a_cancel_of_a_held_request_ends_it_and_its_place_frees() -> None:
    scheduler = Scheduler(Capabilities(parallel=1 + 1, no_batch=None))
    scheduler.take(submit("a", "b", "c"))
    assert scheduler.turn() == BatchTurn(("a", "b"))
    intake = scheduler.take([Cancel("a"), Cancel("nobody")])
    assert intake.cancelled == ["a"]  # a cancel for a request not held (already finished) is nothing
    assert scheduler.turn() == BatchTurn(("c",))


def test_a_stop_ends_everything_held_and_everything_in_its_drain() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a"))
    intake = scheduler.take([*submit("b"), Stop("going down"), *submit("c")])
    assert intake.stop == "going down"
    assert [(name, f.reason, f.error) for name, f in intake.finished] == [("b", "error", "going down")]
    assert intake.admitted == [] and scheduler.held == 0  # "a" is the worker's to end; "c" came after the stop


def test_prompt_scoring_is_refused_with_the_reason_where_the_model_cannot() -> None:
    scheduler = Scheduler(Capabilities(parallel=1, no_batch="sharded", no_prompt_scoring="sharded here"))
    intake = scheduler.take([Submit(request("echo", prompt_logprobs=True)), *submit("plain")])
    ((name, finish),) = intake.finished
    assert (name, finish.reason, finish.error_type) == ("echo", "error", "invalid_request_error")
    assert finish.error is not None and "sharded here" in finish.error
    assert [(r.id, place) for r, place in intake.admitted] == [("plain", "solo")]


def test_a_prompt_is_scored_a_chunk_a_turn_taking_turns_with_the_batch() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a", "b"))
    assert scheduler.turn() == BatchTurn(("a", "b"))
    intake = scheduler.take([Submit(request("echo", prompt_logprobs=True))])
    assert [(r.id, place) for r, place in intake.admitted] == [("echo", "scoring")]
    # A chunk of its prompt, then a step of the others, and so on: never two scoring turns in a row.
    assert [scheduler.turn() for _ in range(4)] == [ScoreTurn("echo"), BatchTurn(()), ScoreTurn("echo"), BatchTurn(())]
    scheduler.ended("a")
    scheduler.ended("b")
    assert [scheduler.turn(), scheduler.turn()] == [ScoreTurn("echo"), ScoreTurn("echo")]  # nobody else to wait on
    # Scored with nobody else held: it decodes alone.
    scheduler.scored("echo")
    assert scheduler.place("echo") == "solo" and scheduler.turn() == SoloTurn("echo")


def test_a_scored_prompt_beside_others_waits_for_a_place_and_a_solo_one_joins_the_batch_as_it_arrives() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take(submit("a"))
    assert scheduler.turn() == SoloTurn("a")
    intake = scheduler.take([Submit(request("echo", prompt_logprobs=True))])
    assert intake.to_batch == ["a"]  # as for any arrival: the solo sequence moves into the batch
    assert [scheduler.turn(), scheduler.turn()] == [ScoreTurn("echo"), BatchTurn(())]
    scheduler.scored("echo")
    assert scheduler.place("echo") == "waiting"
    assert scheduler.turn() == BatchTurn(("echo",))


def test_with_one_slot_a_prompt_is_scored_between_the_solo_turns() -> None:
    scheduler = Scheduler(ONE_SLOT)
    scheduler.take([*submit("a"), Submit(request("echo", prompt_logprobs=True))])
    assert [scheduler.turn() for _ in range(3)] == [ScoreTurn("echo"), SoloTurn("a"), ScoreTurn("echo")]
    scheduler.scored("echo")
    assert scheduler.place("echo") == "solo"
    assert scheduler.turn() == SoloTurn("a")  # the oldest, to its end
    scheduler.ended("a")
    assert scheduler.turn() == SoloTurn("echo")


def test_a_lost_batch_leaves_one_slot_and_every_held_sequence_solo() -> None:
    scheduler = Scheduler(BATCH4)
    scheduler.take([*submit("a", "b", "c"), Submit(request("echo", prompt_logprobs=True))])
    scheduler.turn()
    scheduler.turn()
    scheduler.ended("a")  # the failed step ended those in it; the rest decode one at a time
    scheduler.batch_lost("the batch could not be rebuilt")
    assert not scheduler.capabilities.batching and scheduler.capabilities.parallel == 1
    assert scheduler.place("echo") == "scoring"  # its prompt is still to be scored, between the solo turns
    assert [scheduler.turn(), scheduler.turn()] == [ScoreTurn("echo"), SoloTurn("b")]
    scheduler.take(submit("d"))
    assert scheduler.place("d") == "solo"


def test_the_burst_runs_only_where_the_model_can_the_policy_lets_it_and_no_logprobs_are_asked() -> None:
    can = Capabilities(no_burst=None)
    assert burst_allowed(can, request("a"), policy_allows=True)
    assert not burst_allowed(can, request("a"), policy_allows=False)
    assert not burst_allowed(can, request("a", logprobs=True), policy_allows=True)
    assert not burst_allowed(Capabilities(no_burst="no drafter"), request("a"), policy_allows=True)


def test_the_scheduler_imports_neither_mlx_nor_trio() -> None:
    source = Path(__file__).parents[2] / "mlxcel" / "engine" / "scheduler.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "collections", "dataclasses", "typing"}
