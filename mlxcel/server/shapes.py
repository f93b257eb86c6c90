"""OpenAI's response shapes, per choice: text, logprobs, finish reasons, usage.

Everything here follows OpenAI's published OpenAPI document (the tests validate
every body and stream chunk against it): a chat message carries
``refusal: null``, chat logprobs carry ``refusal: null`` beside ``content``, and
completions logprobs are four parallel arrays (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import Finish, PromptLogprobs, TextDelta
from .tokens import Tokens

UNLIKELY = -9999.0
"""The log-probability reported for an excluded token (-inf), as OpenAI reports one."""


@dataclass
class ChoiceLog:
    """What one choice has produced so far: its deltas, its finish, and the text offset reached."""

    deltas: list[TextDelta]
    finish: Finish | None = None
    offset: int = 0
    """Characters before the next token in the choice's text (the echoed prompt included)."""


def reason(finish: Finish) -> str:
    return "length" if finish.reason == "length" else "stop"


def tool_reason(reason: str, calls: Sequence[Any]) -> str:
    """A choice that ended by itself after calling tools finished with ``tool_calls`` (OpenAI's reason)."""
    return "tool_calls" if calls and reason == "stop" else reason


def tool_delta(index: int, call: dict[str, Any]) -> dict[str, Any]:
    """A chat chunk's choice carrying one tool-call delta."""
    return {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}


def usage(finishes: Sequence[Finish]) -> dict[str, Any]:
    """OpenAI's usage for a request's choices: one prompt, every choice's completion.

    ``cached_tokens`` is the prompt tokens the first choice reused from the prefix cache.
    """
    prompt = finishes[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finishes[0].timings.cached_n}}


class LogprobShaper:
    """Turns a request's token ids and log-probabilities into OpenAI's logprobs objects.

    *alternatives* is how many most likely tokens each position lists (chat
    ``top_logprobs``, completions ``logprobs``). In completions, OpenAI always
    lists the chosen token among them too, so a position has up to
    *alternatives* + 1 entries there. *token_bytes* gives each token's own
    bytes (chat's ``bytes``): a byte-level token may be part of a UTF-8
    character, whose decoded text is only U+FFFD. When it gives None (a
    tokenizer without a byte table), ``bytes`` are those of the token's text.
    """

    def __init__(self, tokens: Tokens, tokenizer: Any, chat: bool, alternatives: int,
                 token_bytes: Callable[[Sequence[int]], list[bytes] | None]) -> None:
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.chat = chat
        self.alternatives = alternatives
        self.token_bytes = token_bytes

    async def shape(self, deltas: Sequence[TextDelta], log: ChoiceLog) -> dict[str, Any]:
        """The logprobs of *deltas* (the whole choice, or one stream chunk), advancing *log*'s offset."""
        ids = [t for d in deltas for t in d.token_ids]
        # A token a grammar or a -100 bias excludes has logprob -inf, which JSON cannot carry:
        # OpenAI's stand-in for "very unlikely" is -9999.0.
        values = [max(v, UNLIKELY) for d in deltas for v in (d.logprobs or ())]
        tops = [tuple((t, max(v, UNLIKELY)) for t, v in top) for d in deltas for top in (d.top_logprobs or ())]
        if not self.alternatives:
            tops = [() for _ in ids]
        pieces = await self.tokens.pieces(self.tokenizer, ids)
        alternative_ids = [t for top in tops for t, _ in top]
        alternatives = await self.tokens.pieces(self.tokenizer, alternative_ids)
        if self.chat:
            own = self.token_bytes(ids + alternative_ids)
            if own is None:
                own = [p.encode() for p in pieces] + [a.encode() for a in alternatives]
            chosen, others, named = iter(own[:len(ids)]), iter(own[len(ids):]), iter(alternatives)
            return {"content": [
                {"token": p, "logprob": v, "bytes": list(next(chosen)),
                 "top_logprobs": [{"token": next(named), "logprob": w, "bytes": list(next(others))}
                                  for _, w in top]}
                for p, v, top in zip(pieces, values, tops, strict=True)], "refusal": None}
        keys = iter(self._keys(alternative_ids, alternatives))
        return self._arrays(pieces, self._keys(ids, pieces), values, [[(next(keys), v) for _, v in top]
                                                                     for top in tops], log)

    async def shape_prompt(self, ids: Sequence[int], scores: PromptLogprobs, log: ChoiceLog) -> dict[str, Any]:
        """Completions logprobs of the echoed prompt *ids*, advancing *log*'s offset: the first token has
        nothing before it, so its log-probability and alternatives are null (as OpenAI sends them)."""
        values = [max(v, UNLIKELY) for v in scores.logprobs]
        tops = [tuple((t, max(v, UNLIKELY)) for t, v in top) for top in scores.top_logprobs or ()] \
            if self.alternatives else [() for _ in values]
        pieces = await self.tokens.pieces(self.tokenizer, ids)
        alternative_ids = [t for top in tops for t, _ in top]
        named = iter(self._keys(alternative_ids, await self.tokens.pieces(self.tokenizer, alternative_ids)))
        keys = self._keys(ids, pieces)
        first = self._arrays(pieces[:1], keys[:1], [0.0], [[]], log)
        rest = self._arrays(pieces[1:], keys[1:], values, [[(next(named), v) for _, v in top] for top in tops], log)
        return {"tokens": pieces, "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": first["text_offset"] + rest["text_offset"]}

    def _keys(self, ids: Sequence[int], pieces: list[str]) -> list[str]:
        """Completions' ``top_logprobs`` keys: each token's text, or, for a token whose bytes are not whole
        UTF-8 (a piece of a character: its text is only U+FFFD), ``bytes:`` and its bytes escaped, as OpenAI
        writes them (``bytes:\\xe6\\x97``), so that N alternatives are N keys. Without a byte table, the texts."""
        own = self.token_bytes(ids) if ids else []
        if own is None:
            return pieces
        return [piece if _whole_utf8(raw) else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                for piece, raw in zip(pieces, own, strict=True)]

    @staticmethod
    def _arrays(pieces: list[str], keys: list[str], values: list[float], top_named: list[list[tuple[str, float]]],
                log: ChoiceLog) -> dict[str, Any]:
        """Completions' four parallel arrays, advancing *log*'s offset past *pieces* (*keys*: the chosen
        tokens' ``top_logprobs`` keys)."""
        offsets = []
        for piece in pieces:
            offsets.append(log.offset)
            log.offset += len(piece)
        # The chosen token is always listed (OpenAI's rule), after the alternatives if it is not one.
        top_maps = [{**dict(top), key: v} for key, v, top in zip(keys, values, top_named, strict=True)]
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": top_maps, "text_offset": offsets}


def _whole_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return then or first
    return {key: first[key] + then[key] for key in first}


def choice(chat: bool, index: int, text: str, finish_reason: str | None, logprobs: Any,
           delta: bool, first: bool = False, tool_calls: list[dict[str, Any]] | None = None,
           reasoning: str = "") -> dict[str, Any]:
    """One entry of ``choices``: a completion's text, a chat message, or a chat delta (*first*: with the role).

    A message with *tool_calls* has ``content`` null unless the model also wrote text (not only whitespace).
    *reasoning* goes under both names clients read it by (``reasoning_content``: vLLM's and DeepSeek's;
    ``reasoning``: mlx-lm's, Ollama's and OpenRouter's); a delta of reasoning alone has no ``content``.
    """
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    thought = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
    if delta:
        content: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or not reasoning:
            content["content"] = text
        return {"index": index, "delta": {**content, **thought}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    # Beside calls, whitespace alone (the newlines a model writes around them) is no content.
    message: dict[str, Any] = {"role": "assistant", "content": text if text.strip() or not tool_calls else None,
                               "refusal": None, **thought}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
