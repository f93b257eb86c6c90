"""A generation request's prompt as token ids: the chat template rendered, or the prompt as sent,
refused with a 400 when it cannot fit the context (by its length alone where it can: before encoding)."""

from __future__ import annotations

from typing import Any

from ..http.errors import ApiError, bad_request
from ..observability import ModelLimits
from .context import ServerContext
from .fim import fim_format, fim_prompt
from .schemas import ChatCompletionRequest, CompletionRequest
from .tools import ToolSetup, template_messages


def too_long(ctx: ServerContext, chat: bool, prompt: str, completion: int) -> ApiError:
    """The 400 for a prompt of *prompt* tokens (a count, or "at least N") that leaves no room for *completion*."""
    return bad_request(
        f"this model's maximum context length is {ctx.options.context_length} tokens, but the "
        f"request needs {prompt} for the prompt and {completion} for the completion",
        param="messages" if chat else "prompt", code="context_length_exceeded")


async def _encode(ctx: ServerContext, chat: bool, text: str, completion: int, **kwargs: Any) -> list[int]:
    """*text*'s tokens, refusing it by its length alone when it cannot fit the context."""
    tokenizer, tokens = ctx.engine.tokenizer, ctx.tokens
    if len(text) > ctx.options.context_length:  # each token covers at least one character
        least = await tokens.min_tokens(tokenizer, text)
        if least + completion > ctx.options.context_length:
            raise too_long(ctx, chat, f"at least {least}", completion)
    # The text is UTF-8 without lone surrogates (checked with the body): if the tokenizer still
    # fails, that is the server's fault, a 500.
    return await tokens.encode(tokenizer, text, **kwargs)


async def prompt_tokens(ctx: ServerContext, params: CompletionRequest | ChatCompletionRequest, limits: ModelLimits,
                        completion: int, tools: ToolSetup | None) -> list[int]:
    """The request's prompt tokens; *tools* (from ``structured.constraints``) are rendered into a chat."""
    tokenizer = ctx.engine.tokenizer
    if isinstance(params, ChatCompletionRequest):
        messages = template_messages(params.messages)
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        # tool_choice "none" renders no tools: the model is not told of calls it may not make.
        rendered_tools = tools.tools if tools is not None else None
        kwargs = params.template_kwargs()

        def render() -> str:
            return str(tokenizer.apply_chat_template(messages, tools=rendered_tools, add_generation_prompt=True,
                                                     tokenize=False, **kwargs))

        try:
            text = await ctx.tokens.run(render)
        except Exception as exc:  # a template that rejects these messages
            raise bad_request(f"the chat template cannot render these messages: {exc}",
                              param="messages") from exc
        # What apply_chat_template(tokenize=True) does, in two steps so the length bound comes first.
        return await _encode(ctx, True, text, completion, add_special_tokens=False)
    prompt: str | list[int] | list[str] = params.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt",
                              code="unsupported_parameter")
        prompt = str(prompt[0])
    if params.suffix:
        return await _encode(ctx, False, _fill_in_the_middle(ctx, params, prompt), completion)
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        return await _encode(ctx, False, prompt, completion)
    if len(prompt) + completion > ctx.options.context_length:  # before looking at every id
        raise too_long(ctx, False, f"{len(prompt)}", completion)
    rows = limits.embedding_size
    if not prompt or any(not isinstance(t, int) or not 0 <= t < rows for t in prompt):
        raise bad_request(f"prompt token ids must be a non-empty list of integers from 0 to {rows - 1}",
                          param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def _fill_in_the_middle(ctx: ServerContext, params: CompletionRequest, prompt: str | list[int] | list[str]) -> str:
    """The prompt asking the model for the text between ``prompt`` and ``suffix``, or a 400 saying why not."""
    form = fim_format(ctx.engine.tokenizer)
    if form is None:
        raise bad_request("suffix needs a model trained to fill in the middle, and this model's vocabulary has "
                          "none of the known fill-in-the-middle tokens", param="suffix", code="unsupported_parameter")
    if not isinstance(prompt, str):
        raise bad_request("suffix is only supported with a text prompt", param="suffix")
    if params.echo:
        raise bad_request("echo is not supported with suffix", param="echo")
    return fim_prompt(form, prompt, params.suffix or "")
