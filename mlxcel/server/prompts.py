"""A generation request's prompt as token ids: the chat template rendered, or the prompt as sent,
refused with a 400 when it cannot fit the context (by its length alone where it can: before encoding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import trio

from ..http.errors import ApiError, bad_request
from ..models.images import PromptImage
from ..observability import ModelLimits
from .context import ServerContext
from .fim import fim_format, fim_prompt
from .image_fetch import fetch_all
from .images import DecodedImage, decode_all
from .schemas import ChatCompletionRequest, CompletionRequest
from .tools import ToolSetup, template_messages
from .wire import off_the_loop_if_large


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


class Prompt(NamedTuple):
    tokens: list[int]
    checkpoints: tuple[int, ...] = ()
    """Positions worth a snapshot of the cache (see ``GenerationRequest.checkpoints``): a chat's, for a model
    whose cache cannot be rewound."""
    images: tuple[PromptImage, ...] = ()
    """A vision model's images, in prompt order (``GenerationRequest.images``)."""


async def prompt_tokens(ctx: ServerContext, params: CompletionRequest | ChatCompletionRequest, limits: ModelLimits,
                        completion: int, tools: ToolSetup | None, checkpoints: bool = True) -> Prompt:
    """The request's prompt; *tools* (from ``structured.constraints``) are rendered into a chat; *checkpoints*:
    find them, where the model needs them (not for a prompt only counted)."""
    if isinstance(params, ChatCompletionRequest):
        return await _chat_prompt(ctx, params, limits, completion, tools, checkpoints)
    prompt: str | list[int] | list[str] = params.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt",
                              code="unsupported_parameter")
        prompt = str(prompt[0])
    if params.suffix:
        return Prompt(await _encode(ctx, False, _fill_in_the_middle(ctx, params, prompt), completion))
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        return Prompt(await _encode(ctx, False, prompt, completion))
    if len(prompt) + completion > ctx.options.context_length:  # before looking at every id
        raise too_long(ctx, False, f"{len(prompt)}", completion)
    rows = limits.embedding_size
    if not prompt or any(not isinstance(t, int) or not 0 <= t < rows for t in prompt):
        raise bad_request(f"prompt token ids must be a non-empty list of integers from 0 to {rows - 1}",
                          param="prompt")
    return Prompt(list(prompt))  # type: ignore[arg-type]


async def _images(ctx: ServerContext, params: ChatCompletionRequest) -> list[DecodedImage]:
    """The conversation's images, each checked and decoded on a worker thread (:mod:`.images`); a model that reads
    text only refuses them, after the checks (a broken image is named as such wherever it is sent)."""
    refs = params.image_refs()
    if not refs:
        return []
    refs = await fetch_all(refs, ctx.options.image_limits)
    images = await trio.to_thread.run_sync(decode_all, refs, ctx.options.image_limits)
    if ctx.options.image_prompt is None:
        raise bad_request(f"the model {ctx.options.model_name!r} reads text only: it takes no images",
                          param=refs[0].where.split(".")[0], code="model_not_supported")
    return images


def _expanded(text: str, images: list[DecodedImage], prompt: Any) -> str:
    """*text* (the rendered prompt) with each image's marker become its span, sized for that image."""
    pieces = text.split(prompt.placeholder)
    if len(pieces) != len(images) + 1:
        raise bad_request(f"the prompt holds {len(pieces) - 1} image markers ({prompt.placeholder!r}) for "
                          f"{len(images)} images: a message's text may not write the marker itself",
                          param="messages")
    try:
        spans = [prompt.expansion(image.width, image.height) for image in images]
    except ValueError as exc:  # a size the model's processor cannot take (a 1 x 500 sliver)
        raise bad_request(f"an image cannot be read by this model: {exc}", param="messages",
                          code="invalid_image") from exc
    return pieces[0] + "".join(span + piece for span, piece in zip(spans, pieces[1:], strict=True))


async def _chat_prompt(ctx: ServerContext, params: ChatCompletionRequest, limits: ModelLimits, completion: int,
                       tools: ToolSetup | None, checkpoints: bool) -> Prompt:
    images = await _images(ctx, params)
    tokenizer = ctx.engine.tokenizer
    messages = await off_the_loop_if_large(template_messages, params.messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    # tool_choice "none" renders no tools: the model is not told of calls it may not make.
    rendered_tools = tools.tools if tools is not None else None
    kwargs = params.template_kwargs()

    def render(turns: list[dict[str, Any]], generation: bool = True) -> str:
        return str(tokenizer.apply_chat_template(turns, tools=rendered_tools, add_generation_prompt=generation,
                                                 tokenize=False, **kwargs))

    try:
        text = await ctx.tokens.run(render, messages)
    except Exception as exc:  # a template that rejects these messages
        raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from exc
    if images:
        text = _expanded(text, images, ctx.options.image_prompt)
    # What apply_chat_template(tokenize=True) does, in two steps so the length bound comes first.
    tokens = await _encode(ctx, True, text, completion, add_special_tokens=False)
    if images:  # no snapshots: nothing of a prompt with images is kept (GenerationRequest.images)
        return Prompt(tokens, images=tuple(PromptImage(image.digest, image.rgb) for image in images))
    if not (checkpoints and limits.snapshots):
        return Prompt(tokens)
    return Prompt(tokens, await _checkpoints(ctx, render, messages, text, tokens))


async def _checkpoints(ctx: ServerContext, render: Callable[..., str], messages: list[dict[str, Any]], text: str,
                       tokens: list[int]) -> tuple[int, ...]:
    """Where a later prompt of the same conversation, or of another sharing its system prompt, is likely to
    share this one's tokens up to: the end of the system prompt (tools included), and the end of the
    conversation before the generation prompt (which the next turn replaces with the reply: with a thinking
    template's open ``<think>``, the end of the prompt itself is not shared). A position is kept only where the
    text's tokens there are the prompt's own (tokenizing the part alone gives the same ids)."""
    tokenizer, marks = ctx.engine.tokenizer, set()
    try:
        bare = await ctx.tokens.run(render, messages, False)
        if text.startswith(bare) and len(bare) < len(text):
            tail = await ctx.tokens.encode(tokenizer, text[len(bare):], add_special_tokens=False)
            if 0 < len(tail) < len(tokens) and tokens[-len(tail):] == tail:
                marks.add(len(tokens) - len(tail))
        system = next((i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")), 0)
        if system:
            head = await ctx.tokens.run(render, messages[:system], False)
            if text.startswith(head):
                ids = await ctx.tokens.encode_remembered(tokenizer, head, add_special_tokens=False)
                if 0 < len(ids) < len(tokens) and tokens[:len(ids)] == ids:
                    marks.add(len(ids))
    except Exception:  # a template that cannot render part of a chat: no snapshot there, nothing else lost
        pass
    return tuple(sorted(marks))


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
