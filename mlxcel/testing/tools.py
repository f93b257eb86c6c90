"""A tiny llama that answers every chat with one fixed text: a tool call, for the ``tool_choice: auto`` tests.

A random model never writes a tool call by itself. This one is built to: its
attention and MLP outputs are zero, so the hidden state at the last layer is
the current token's embedding and the next token is a fixed function of the
current one. The LM head makes that function a chain: the chat template's
last token (``\\n`` after ``assistant``) -> each piece of :data:`SCRIPT` in
turn -> ``<|im_end|>``. Each piece is a token of its own (added to the
tokenizer, not special, so it decodes as its text), so no piece repeats a
token and greedy decoding spells the script exactly. The files are a real
Hugging Face llama checkpoint; the server serves it like any other.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from mlxcel.testing.base import TOOLS_CHATML, write_tokenizer
from mlxcel.testing.checkpoints import CONFIGS

SCRIPT = ("Checking.", "<tool_call>", '{"name":"get_weather",', '"arguments":{"city":"Paris"}}', "</tool_call>")
"""The answer, piece by piece: some content, then a call in the Hermes / Qwen format (mlx-lm's json_tools)."""


def build_scripted_checkpoint(directory: Path, script: tuple[str, ...] = SCRIPT,
                              chat_template: str = TOOLS_CHATML, context: int | None = None,
                              markers: tuple[str, ...] = (), after: str = "assistant\n") -> Path:
    """A llama answering every chat with *script*; *chat_template* names its tool-call format to mlx-lm.
    *context*: its context length (``max_position_embeddings``), for a coding agent's long prompts.
    *markers*: more tokens for the vocabulary (``<think>``, ...), which mlx-lm reads a model's formats from.
    *after*: the text whose last token starts the chain (a chat's generation prompt ends with it)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, chat_template, added=tuple(dict.fromkeys((*script, *markers))))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = {**CONFIGS["llama"], "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
              **({"max_position_embeddings": context} if context else {})}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    chain = [tokenizer.encode(after).ids[-1], *(tokenizer.token_to_id(p) for p in script),
             tokenizer.token_to_id("<|im_end|>")]
    assert None not in chain and len(set(chain)) == len(chain), chain
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {name: (mx.zeros_like(v) if name.endswith(("o_proj.weight", "down_proj.weight")) else v)
               for name, v in weights.items()}
    embed = mx.random.normal(weights["model.embed_tokens.weight"].shape)
    normed = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True))  # what the final RMSNorm gives
    head = 0.01 * mx.random.normal(weights["lm_head.weight"].shape)
    for current, following in itertools.pairwise(chain):
        head[following] = normed[current]  # the following token's logit: |normed|^2 = hidden size
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    return directory
