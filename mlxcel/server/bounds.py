"""How much one request may hold: the bounds every route's request schema applies (``docs/http-api.md``).

Each is the cost a request can put on the server's shared parts (the engine's
per-token checks, a chat template's render, the event loop) kept to a size no
real client needs more than.
"""

from __future__ import annotations

from typing import Any

MAX_STOP_STRINGS = 32
"""More than OpenAI's 4 (vLLM and llama.cpp take more); the engine checks every one per token."""
MAX_STOP_CHARS = 1000
"""Per stop string. Bounded because the engine checks every stop string at every token."""
MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects in a body; a real request needs four."""
SEED_RANGE = (-(2**63), 2**63)
"""OpenAI's int64; MLX's random keys take [0, 2**64), so the seed is taken modulo 2**64."""
MAX_CHOICES = 16
"""``n``: every choice is a sequence of its own in the engine, holding one of its places."""
MAX_LOGIT_BIAS = 300
"""Entries of ``logit_bias``, as OpenAI's limit."""
MAX_TOOLS = 128
"""Tools of one request, as OpenAI's limit."""
MAX_TEMPLATE_KWARGS = 32
"""Entries of ``chat_template_kwargs``; a template reads a handful."""
MAX_TEMPLATE_KWARG_VALUES = 10_000
"""Values (each array, object, string and number, however nested) of all ``chat_template_kwargs`` together: a
template walks them as it renders (Llama 3.1's ``custom_tools``: 350k empty objects took 4.4-5.2 s of render,
holding every other request's). 10,000 is 128 tools' worth (the ``tools`` bound) of ordinary schemas."""
MAX_MESSAGES = 10_000
"""Messages of one conversation (the Responses API's input items too): the template renders each, the body
bound alone let 120k empty ones through (1.8-3.0 s of render each request). None fits a context beyond a few
thousand anyway: each costs the template's own tokens."""
MAX_CONTENT_PARTS = 20_000
"""Content parts, blocks and tool calls of all of a conversation's messages together."""
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "chat_template"})
"""What the server itself passes to ``apply_chat_template``: a request's ``chat_template_kwargs`` may not set it."""


def check_parts(parts: int, what: str) -> None:
    """Raise (a 400 naming the field) when a request's *parts* (its *what*, every message's counted together)
    exceed :data:`MAX_CONTENT_PARTS`: a chat template renders each."""
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"{parts} {what} in all, more than {MAX_CONTENT_PARTS}")


def declared_type(value: Any) -> str | None:
    """The ``type`` a tagged union's member declares, from a dict or a model (None: none that is a string)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None
