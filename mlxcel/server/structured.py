"""Grammars for constrained decoding: ``response_format`` and forced tool calls, in llguidance's form.

llguidance compiles a JSON schema into a grammar, and the grammar into a
matcher over the served vocabulary (:mod:`mlxcel.server.matchers`), which the
engine follows token by token (:mod:`mlxcel.engine.grammar`). Both happen
here, in the HTTP layer's threads, before anything is submitted: a schema
llguidance cannot compile is a 400 naming the parameter, not a failed
generation, and the engine's decode loop never waits on a compile. No mlx here.

The JSON is compact (``","`` and ``":"``, no whitespace between tokens):
a model under a grammar that allows free whitespace can spend its whole
budget on newlines.
"""

from __future__ import annotations

import json
from typing import Any

from ..http.errors import bad_request
from .context import ServerContext
from .matchers import GrammarProblem, compile_matchers, parser_limits
from .native import run_native
from .schema_bounds import DATA_KEYWORDS, check_schema
from .schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tools import ToolProblem, ToolSetup, tool_setup

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the grammar spells JSON: one space after ``,`` and ``:``, none elsewhere (as ``json.dumps``)."""


def from_schema(schema: dict[str, Any]) -> str:
    """The llguidance grammar for JSON that matches *schema*; raises :class:`GrammarProblem`.

    The schema is bounded first (:mod:`~mlxcel.server.schema_bounds`): one too deep for llguidance's
    recursion would overflow this thread's stack and take the process down.
    """
    from llguidance import LLMatcher

    text = json.dumps(schema)
    try:
        check_schema(schema, text)
        grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:  # SchemaTooLarge is one
        raise GrammarProblem((str(exc).splitlines() or ["llguidance refused the schema"])[0]) from exc
    problem = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if problem:
        raise GrammarProblem(problem.splitlines()[0])
    return grammar


ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""``response_format: json_object``: any JSON object (OpenAI's JSON mode)."""


def tool_arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of one function's arguments (no ``parameters``: an object of anything)."""
    return parameters if parameters is not None else ANY_OBJECT


def required_calls_schema(functions: list[tuple[str, dict[str, Any] | None]], single: bool) -> dict[str, Any]:
    """``tool_choice: required``: a non-empty array of ``{"name", "arguments"}``, each naming one of *functions*
    (*single*: exactly one, for ``parallel_tool_calls: false``).

    The same shape vLLM forces for ``required``; the output is read as JSON, not in the family's own format.
    Each function's arguments schema moves to ``$defs`` of the whole, its own references with it
    (:func:`relocated`), so that a ``$ref`` in it still finds its target; its root ``$id`` is dropped (it is
    no longer a root).
    """
    defs = {f"tool{i}": relocated({k: v for k, v in tool_arguments_schema(parameters).items() if k != "$id"},
                                  f"#/$defs/tool{i}")
            for i, (_, parameters) in enumerate(functions)}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, (name, _) in enumerate(functions)]
    return {"$defs": defs, "type": "array", "minItems": 1, **({"maxItems": 1} if single else {}),
            "items": {"anyOf": calls}}


def relocated(schema: Any, base: str) -> Any:
    """*schema* to be placed at the JSON pointer *base* of another: its local references (``#``, ``#/...``) are
    rewritten to point under *base*. Values (``const``, ``enum``, ``default``, ``examples``) are data and stay
    as they are."""
    if isinstance(schema, list):
        return [relocated(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: value if key in DATA_KEYWORDS else relocated(value, base) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str) and (reference == "#" or reference.startswith("#/")):
        moved["$ref"] = base + reference[1:]
    return moved


def check_tool_choice(params: ChatCompletionRequest) -> None:
    """A ``tool_choice`` that forces a call (``required``, a named function) needs tools: a 400 otherwise, on
    every route that takes one (``/v1/messages``' ``any`` and ``tool``, ``count_tokens`` too)."""
    if not params.tools and (params.tool_choice == "required" or isinstance(params.tool_choice, NamedToolChoice)):
        raise bad_request("tool_choice needs tools", param="tool_choice")


async def constraints(params: CompletionRequest | ChatCompletionRequest, ctx: ServerContext,
                      copies: int) -> tuple[ToolSetup | None, list[Any] | None]:
    """How the output is read for tool calls, and *copies* matchers of the grammar it must follow
    (``response_format``, a forced tool call; one per sequence), if any. A bad combination, a schema
    llguidance cannot compile, or a tokenizer it cannot read is a 400 on the parameter that sent it."""
    tokenizer = ctx.engine.tokenizer
    schema = params.response_format.target_schema() if params.response_format is not None else None
    param, setup = "response_format", None
    if isinstance(params, ChatCompletionRequest):
        mode = params.tool_mode()
        check_tool_choice(params)
        tools = [tool.model_dump(exclude_none=True) for tool in params.tools or []]
        named = params.tool_choice.function.name if isinstance(params.tool_choice, NamedToolChoice) else None
        try:
            setup = tool_setup(mode, tools, named, params.parallel_tool_calls is False, tokenizer)
        except ToolProblem as exc:
            raise bad_request(str(exc), param="tools") from exc
        if setup is not None and schema is not None:
            raise bad_request("response_format with tools is not supported: both would constrain the output "
                              "(send tool_choice 'none' for a JSON answer)", param="response_format",
                              code="unsupported_parameter")
        functions = [(t.function.name, t.function.parameters) for t in params.tools or []]
        if mode == "named":
            schema, param = tool_arguments_schema(dict(functions)[named]), "tools"  # type: ignore[index]
        elif mode == "required":
            schema, param = required_calls_schema(functions, setup is not None and setup.single), "tools"
    if schema is None:
        return setup, None
    try:
        grammar = await run_native(lambda: from_schema(schema), ctx.engine)
        return setup, await compile_matchers(grammar, copies, ctx.engine)
    except GrammarProblem as exc:
        raise bad_request(f"{param}: constrained decoding cannot serve this request: {exc}",
                          param=param) from exc
