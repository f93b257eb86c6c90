"""A JSON schema can no longer take the server down: it is bounded before llguidance sees it.

llguidance 1.9 compiles a schema by native recursion, following each ``$ref``;
a chain of about 925 references overflowed its thread's stack and the process
died with SIGSEGV (every stream cut, nothing in the log). The server now
measures the schema first (``mlxcel/server/schema_bounds.py``). The servers
here are subprocesses, so that a crash is a failed test, not a dead test run.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.server.schema_bounds import (
    MAX_OPTIONAL_PROPERTIES,
    MAX_PATTERN_COST,
    MAX_SCHEMA_BYTES,
    SchemaTooLarge,
    check_schema,
    pattern_cost,
)
from mlxcel.testing.base import TOOLS_CHATML, write_tokenizer
from mlxcel.testing.checkpoints import build_checkpoint
from mlxcel.testing.serving import serve_subprocess
from tests.server.conftest import running_server

Link = Callable[[str], dict[str, Any]]
#: One link of a reference chain per keyword that can hold a subschema: each wraps a ``$ref`` to the next link.
LINKS: dict[str, Link] = {
    "properties": lambda ref: {"type": "object", "properties": {"a": {"$ref": ref}}},
    "alias": lambda ref: {"$ref": ref},
    "allOf": lambda ref: {"allOf": [{"$ref": ref}]},
    "anyOf": lambda ref: {"anyOf": [{"$ref": ref}, {"type": "integer"}]},
    "items": lambda ref: {"type": "array", "items": {"$ref": ref}},
    "prefixItems": lambda ref: {"type": "array", "prefixItems": [{"$ref": ref}]},
    "additionalProperties": lambda ref: {"type": "object", "additionalProperties": {"$ref": ref}},
    "nested": lambda ref: {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"anyOf": [{"$ref": ref}]}}}}}},
}


def chain(links: int, link: Link = LINKS["properties"]) -> dict[str, Any]:
    """``$defs`` d0 -> d1 -> ... -> a string, and the root a reference to d0: the schema that crashed the server."""
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def accepted(schema: Any) -> bool:
    try:
        check_schema(schema, json.dumps(schema))
    except SchemaTooLarge:
        return False
    return True


@functools.cache  # a pure function of the bounds: two tests ask it of every link
def longest_accepted(link: Link) -> int:
    links = 0
    while accepted(chain(links + 1, link)):
        links += 1
    return links


def test_the_reported_chain_and_anything_deeper_than_the_bound_are_refused() -> None:
    assert not accepted(chain(1000))
    assert accepted(chain(10))
    for name, link in LINKS.items():
        assert 10 <= longest_accepted(link) < 130, name  # real chains fit; nothing near the crash (925+) does
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert accepted(tree)  # recursion is a rule referring to itself, not depth
    assert accepted({"type": "object", "properties": {"next": {"$ref": "#"}}})
    doubling = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                           "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    doubling["d40"] = {"type": "string"}
    assert accepted({"$defs": doubling, "$ref": "#/$defs/d0"})  # 2**40 paths, each target measured once


@pytest.mark.parametrize(("schema", "says"), [
    ({"properties": {"a": {"$ref": "#foo"}}}, "only local references"),
    ({"properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only local references"),
    ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
    ({"$id": "root", "properties": {"a": {"$id": "sub", "type": "string"}}}, "only at the schema's root"),
    ({"enum": ["x" * MAX_SCHEMA_BYTES]}, "bytes of JSON"),
])
def test_what_the_walk_cannot_bound_is_refused_with_its_reason(schema: dict[str, Any], says: str) -> None:
    with pytest.raises(SchemaTooLarge, match=says):
        check_schema(schema, json.dumps(schema))


@pytest.mark.parametrize(("pattern", "cost"), [
    ("^a{65535}$", 65535), ("^a{0,65535}$", 65535), ("^a{5,}$", 5), (r"^[a-z]{3}-\d{4}$", 8),
    ("^(a{10}){20}$", 200), ("((a){3}){4}", 12), ("(ab|cd){4}(e){1000}", 1016), ("x{1,2}{3}", 6),
    ("[{]{2000}", 2000), ("[]a]{7}", 7), ("(a|bc|d)", 4),
    ("^" + "a{1000}" * 256 + "$", 256_000), ("^" + "a" * 65535 + "$", 65535),  # sequences add up
    (r"\{2000}", 6), ("a{", 2), ("a{,5}", 5), ("^.*$", 1), ("", 0),  # an escaped brace, not counts: literals
])
def test_a_pattern_costs_its_length_written_out(pattern: str, cost: int) -> None:
    assert pattern_cost(pattern) == cost


def test_a_pattern_that_repeats_past_the_bound_is_refused_wherever_it_is() -> None:
    over = f"^a{{{MAX_PATTERN_COST + 1}}}$"
    for schema in ({"type": "string", "pattern": over},
                   {"type": "object", "patternProperties": {over: {"type": "string"}}},
                   {"properties": {"a": {"type": "string", "pattern": "^(x{30}){40}$"}}}):  # 30 x 40
        with pytest.raises(SchemaTooLarge, match="maxLength"):
            check_schema(schema, json.dumps(schema))
    assert accepted({"type": "string", "pattern": f"^a{{{MAX_PATTERN_COST}}}$", "maxLength": 65535})
    assert accepted({"type": "string", "const": "^a{65535}$"})  # data, not a pattern


SEQUENCE = {"type": "string", "pattern": "^" + "a{1000}" * 256 + "$"}
"""The report's 1.8 KB schema: each count within the old bound, the whole ``a{256000}`` (140 ms of mask a token)."""
LONG_LITERAL = {"type": "string", "pattern": "^" + "a" * 65535 + "$"}
MANY_PATTERNS = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^a{1000}$"}
                                                  for i in range(300)}, "required": [f"p{i}" for i in range(300)]}


def test_a_schema_is_bounded_by_the_sum_of_its_patterns_and_literals_not_its_largest_part() -> None:
    for schema, says in ((SEQUENCE, "a pattern costs 256000"), (LONG_LITERAL, "a pattern costs 65535"),
                         ({"const": "a" * 65535}, "a literal string costs 65535"),
                         ({"enum": ["ok", "b" * 2000]}, "a literal string costs 2000"),
                         (MANY_PATTERNS, "cost 51000 written out together"),
                         ({"$defs": {"p": {"type": "string", "pattern": "^a{900}$"}}, "type": "array", "prefixItems": [
                             {"patternProperties": {"^b{900}$": {}}, "properties": {str(i): {"$ref": "#/$defs/p"}}}
                             for i in range(60)]}, "together")):
        with pytest.raises(SchemaTooLarge, match=says):
            check_schema(schema, json.dumps(schema))
    dates = {"type": "object", "properties": {f"d{i}": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
                                              for i in range(300)}, "required": ["d0"]}
    words = {"enum": [f"word{i:06d}" for i in range(2000)]}
    shared = {"$defs": {"p": {"type": "string", "pattern": "^a{1000}$"}},  # one target, compiled once
              "properties": {str(i): {"$ref": "#/$defs/p"} for i in range(300)}, "required": ["0"]}
    assert accepted(dates) and accepted(words) and accepted(shared)


def _wide(count: int, **keywords: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}, **keywords}


def test_an_object_with_more_optional_properties_than_llguidance_parses_is_refused_wherever_it_is() -> None:
    over = _wide(MAX_OPTIONAL_PROPERTIES + 1)
    for schema in (over, {"type": "array", "items": over}, {"$defs": {"x": over}, "$ref": "#/$defs/x"},
                   _wide(MAX_OPTIONAL_PROPERTIES + 1, required=[])):
        with pytest.raises(SchemaTooLarge, match="none is required"):
            check_schema(schema, json.dumps(schema))
    assert accepted(_wide(MAX_OPTIONAL_PROPERTIES))
    assert accepted(_wide(2000, required=["p1999"]))  # one required: another grammar (the next test parses 600)


def test_the_optional_properties_bound_is_where_llguidance_s_parser_fails(tmp_path: Path) -> None:
    """The bound against the installed llguidance, at its most permissive (``additionalProperties: false``
    puts the fewest items in the row): at the bound an object's first key parses, one more and it fails."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    vocabulary = llguidance.hf.from_tokenizer(tokenizer)

    def first_key_parses(schema: dict[str, Any]) -> bool:
        matcher = llguidance.LLMatcher(vocabulary, llguidance.LLMatcher.grammar_from_json_schema(schema),
                                       log_level=0)
        assert not matcher.get_error(), matcher.get_error()
        return all(matcher.consume_token(t) for t in tokenizer.encode('{"p', add_special_tokens=False))

    assert first_key_parses(_wide(MAX_OPTIONAL_PROPERTIES, additionalProperties=False))
    assert not first_key_parses(_wide(MAX_OPTIONAL_PROPERTIES + 1, additionalProperties=False))
    assert not first_key_parses(_wide(MAX_OPTIONAL_PROPERTIES + 1))
    assert first_key_parses(_wide(MAX_OPTIONAL_PROPERTIES + 100, required=["p0"]))


def test_values_are_data_not_schemas() -> None:
    schema = {"$id": "root", "properties": {"a": {"const": {"$id": "x", "$ref": "#nowhere"}},
                                            "b": {"enum": [{"$ref": "https://example.com"}], "default": {"$id": 1}}}}
    assert accepted(schema)


def test_every_chain_at_the_bound_compiles_in_llguidance_on_a_1_mib_stack() -> None:
    """The library itself, at the longest chain of each kind the bound lets through, on an eighth of the
    default thread stack: a subprocess, so that an overflow fails this test instead of killing the run."""
    schemas = {name: json.dumps(chain(longest_accepted(link), link)) for name, link in LINKS.items()}
    script = textwrap.dedent("""
        import json, sys, threading
        from llguidance import LLMatcher
        schemas = json.loads(sys.stdin.read())
        threading.stack_size(1024 * 1024)
        results = {}
        def compile_all():
            for name, text in schemas.items():
                grammar = LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
                results[name] = LLMatcher.validate_grammar(grammar)
        thread = threading.Thread(target=compile_all)
        thread.start()
        thread.join()
        print(json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(schemas), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == dict.fromkeys(LINKS, "")  # compiled, and valid


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("schema-bounds")
    model = build_checkpoint(root / "llama", "llama", scale=2.0, chat_template=TOOLS_CHATML)
    with serve_subprocess(["--model", str(model)], {}, root / "server.log") as url:
        yield url, root / "server.log"


@pytest.fixture
def server(served: tuple[str, Path]) -> str:
    return served[0]


def as_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def as_tool(schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


@pytest.mark.slow
def test_the_crashing_schema_is_a_400_on_every_route_and_a_stream_in_flight_finishes(server: str) -> None:
    schema = chain(1000)  # the report's: 1,000 links (it crashed from about 925)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies = [
        ("/v1/chat/completions", {**chat, "response_format": as_format(schema)}, "response_format"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": as_format(schema)},
         "response_format"),
        ("/v1/chat/completions", {**chat, "tools": [as_tool(schema)],
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ("/v1/chat/completions", {**chat, "tools": [as_tool(schema)], "tool_choice": "required"}, "tools"),
    ]
    with httpx.Client(base_url=server, timeout=120) as client, client.stream(
            "POST", "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 200, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        for path, body, param in bodies:
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "deeper than 128 levels" in error["message"], error
            assert "\n" not in error["message"]
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        assert client.get("/health").status_code == 200


def test_a_huge_repetition_is_a_400_and_a_bounded_one_is_served(server: str) -> None:
    """The report's 43-byte ``^a{65535}$`` cost 16-20 ms of mask per token per sequence, on the batch's
    critical path: refused before compiling; the bound itself compiles and decodes."""
    with httpx.Client(base_url=server, timeout=120) as client:
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "response_format": as_format(
            {"type": "string", "pattern": "^a{65535}$"})})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "response_format" and "costs 65535 written out" in error["message"], error
        served = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "response_format": as_format(
            {"type": "string", "pattern": f"^a{{{MAX_PATTERN_COST}}}$"})})
        assert served.status_code == 200, served.text
        assert re.fullmatch('"a*', served.json()["choices"][0]["text"])  # cut by max_tokens


@pytest.mark.slow
def test_a_grammar_that_fails_while_decoding_is_one_line_400_and_one_log_line_without_content(
        served: tuple[str, Path]) -> None:
    url, log = served
    wide = {"type": "object", "properties": {f"secret{i}": {"type": "integer"} for i in range(499)}}
    before = log.read_text()
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "private words"}], "max_tokens": 3, "stream": stream,
                "response_format": as_format(wide)}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        if stream:  # the error arrives as an event, then [DONE]
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
        else:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "grammar" in error["message"]
        assert "\n" not in error["message"] and "secret" not in error["message"], error
    added = log.read_text()[len(before):]
    failures = [line for line in added.splitlines() if "failed" in line]
    assert len(failures) == 2 and "secret" not in added and "private" not in added, added
    assert all(" WARNING " in line for line in failures), failures  # the client's grammar: not a server error


LEAF = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object", "array")]),
    st.builds(lambda values: {"enum": values},
              st.lists(st.text(max_size=8) | st.integers() | st.none(), min_size=1, max_size=6)),
    st.builds(lambda value: {"const": value}, st.text(max_size=8) | st.integers()),
    st.builds(lambda pattern: {"type": "string", "pattern": pattern}, st.sampled_from(
        ["^[a-z]+$", r"^\d{3}-\d{4}$", "(", "[a-", "^a{65535}$", r"\p{L}+", "^(a|b)*c$", "^é+ü?$", "😀{2,3}",
         "^(?=a)b$", r"(\w+)\1"])),
    st.builds(lambda fmt: {"type": "string", "format": fmt},
              st.sampled_from(["date-time", "email", "uuid", "ipv4", "no-such-format"])),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              st.integers(-10**6, 10**6), st.integers(-10**6, 10**6)),
    st.builds(lambda n: {"type": "string", "minLength": n, "maxLength": n + 3}, st.integers(0, 40)),
)
NAME = st.text(min_size=1, max_size=6)


def _extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda props, required, extra: {"type": "object", "properties": props,
                                                  "required": required, "additionalProperties": extra},
                  st.dictionaries(NAME, inner, max_size=4), st.lists(NAME, max_size=2), st.booleans() | inner),
        st.builds(lambda items, low: {"type": "array", "items": items, "minItems": low, "maxItems": low + 2},
                  inner, st.integers(0, 3)),
        st.builds(lambda key, options: {key: options}, st.sampled_from(["anyOf", "allOf", "oneOf"]),
                  st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda body: {"$defs": {"x": body}, "$ref": "#/$defs/x"}, inner),
        st.builds(lambda body: {"type": "object", "properties": {"self": {"$ref": "#"}, "v": body}}, inner),
    )


SCHEMA = st.one_of(
    st.recursive(LEAF, _extend, max_leaves=10),
    st.builds(chain, st.integers(0, 1200), st.sampled_from(list(LINKS.values()))),
    st.builds(lambda depth: {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % depth}"},
                                                           {"type": "null"}]} for i in range(depth)},
                             "$ref": "#/$defs/d0"}, st.integers(1, 300)),  # one cycle through every def
    st.builds(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}},
              st.integers(0, 6000)),
)


@pytest.mark.slow
def test_fuzzed_schemas_are_served_or_refused_and_the_server_stays_up(server: str) -> None:
    statuses: list[int] = []
    with httpx.Client(base_url=server, timeout=120) as client:

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(schema=SCHEMA, route=st.sampled_from(["chat", "completions", "tool"]))
        def one(schema: Any, route: str) -> None:
            if route == "tool":
                path, body = "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "x"}], "tools": [as_tool(schema)],
                    "tool_choice": {"type": "function", "function": {"name": "f"}}}
            elif route == "chat":
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "response_format": as_format(schema)}
            else:
                path, body = "/v1/completions", {"prompt": "x", "response_format": as_format(schema)}
            response = client.post(path, json={**body, "max_tokens": 3, "temperature": 0})
            assert response.status_code in (200, 400), response.text
            if response.status_code == 400:
                assert "\n" not in response.json()["error"]["message"]
            statuses.append(response.status_code)

        one()
        assert client.get("/health").status_code == 200
    assert {200, 400} <= set(statuses)  # both outcomes were exercised


@pytest.mark.slow
def test_a_grammar_failing_in_the_batch_ends_its_own_request_only(server: str) -> None:
    """The failing grammar joins a batch beside a long stream: it gets its 400, the stream goes on whole."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(499)}}
    with httpx.Client(base_url=server, timeout=120) as client, client.stream(
            "POST", "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 300, "stream": True,
                                             "temperature": 0}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        failing = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "response_format": as_format(wide)})
        assert failing.status_code == 400 and "grammar" in failing.json()["error"]["message"]
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_the_reported_costly_shapes_are_a_400_on_every_grammar_route(server: str) -> None:
    """Each cost under the old bound (its largest single repetition): a sequence of counts, a long literal,
    many patterns; each on chat (``n: 4``, as the report's), as a forced tool's arguments, and as the
    Responses API's ``text.format``."""
    with httpx.Client(base_url=server, timeout=120) as client:
        for schema in (SEQUENCE, LONG_LITERAL, MANY_PATTERNS):
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 4}
            answers = [client.post("/v1/chat/completions", json={**chat, "response_format": as_format(schema)}),
                       client.post("/v1/chat/completions", json={**chat, "tools": [as_tool(schema)],
                                                                 "tool_choice": "required"}),
                       client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "text": {
                           "format": {"type": "json_schema", "name": "s", "schema": schema}}})]
            for answer in answers:
                assert answer.status_code == 400 and "written out" in answer.json()["error"]["message"], answer.text


async def test_a_grammar_whose_first_mask_costs_too_much_is_refused_before_admission(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop behind the schema's bounds, whatever a schema's shape: llguidance's first mask is timed as
    the grammar compiles. (No schema within the bounds is slow enough on a 1,024-token vocabulary, so the limit
    is lowered here to below what any mask costs.) A first mask that a stall of the machine made slow is timed
    again on a fresh compile (the stall stands in for by a clock that reads 50 ms for the first mask only)."""
    from mlxcel.server import matchers

    monkeypatch.setattr(matchers, "FIRST_MASK_SECONDS", -1.0)
    body = {"prompt": "hi", "max_tokens": 2, "response_format": as_format({"type": "string"})}
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        refused = await client.post("/v1/completions", json=body)
        monkeypatch.setattr(matchers, "FIRST_MASK_SECONDS", 0.010)
        served = await client.post("/v1/completions", json=body)
        readings = iter([1.0, 1.050])  # the first mask's start and end; then the thread's own clock
        clock = SimpleNamespace(thread_time=lambda: next(readings, 0) or time.thread_time())
        monkeypatch.setattr(matchers, "time", clock)
        stalled = await client.post("/v1/completions", json=body)
    assert refused.status_code == 400 and "first mask took" in refused.json()["error"]["message"], refused.text
    assert served.status_code == 200, served.text
    assert stalled.status_code == 200 and next(readings, None) is None, stalled.text
