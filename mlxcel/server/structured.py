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

import trio

from .context import ServerContext
from .errors import bad_request
from .matchers import GrammarProblem, compile_matchers
from .schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tools import ToolProblem, ToolSetup, tool_setup

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the grammar spells JSON: one space after ``,`` and ``:``, none elsewhere (as ``json.dumps``)."""


def from_schema(schema: dict[str, Any]) -> str:
    """The llguidance grammar for JSON that matches *schema*; raises :class:`GrammarProblem`."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarProblem(str(exc)) from exc
    problem = LLMatcher.validate_grammar(grammar)
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
    """
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "arguments": tool_arguments_schema(parameters)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, parameters in functions]
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if single else {}), "items": {"anyOf": calls}}


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
        if not params.tools and (params.tool_choice == "required" or isinstance(params.tool_choice, NamedToolChoice)):
            raise bad_request("tool_choice needs tools", param="tool_choice")
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
        grammar = await trio.to_thread.run_sync(from_schema, schema)
        return setup, await compile_matchers(grammar, copies, ctx.engine)
    except GrammarProblem as exc:
        raise bad_request(f"{param}: constrained decoding cannot serve this request: {exc}",
                          param=param) from exc
