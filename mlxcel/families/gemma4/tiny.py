"""Tiny Gemma 4 targets and assistants, built with transformers' own classes and ``save_pretrained``.

The layout is what a user's download holds: ``config.json`` and ``model.safetensors`` exactly as
transformers writes them (``gemma4_text``, or the ``gemma4`` wrapper with a nested ``text_config``),
and mlxcel/testing/base.py's tokenizer (vocabulary 512).

Besides random models, a pairing whose assistant agrees with its target by construction:

- the *permutation target*: attention and MLP outputs scaled down, so the residual stream is mostly
  the token's own (scaled) embedding, and an untied head whose row ``PERMUTATION[t]`` is token ``t``'s
  embedding: the next token is ``PERMUTATION[current]``, whatever came before;
- the *agreeing assistant*: ``pre_projection`` passes the target embedding through, its layers add
  nothing, and its tied table row ``PERMUTATION[t]`` is the target's embedding of ``t``: its draft
  after token ``t`` is ``PERMUTATION[t]``, the target's own next token. ``agreement`` < 1 re-points
  that share of the rows elsewhere (a partly agreeing assistant).

Both agreements are checked inside transformers by tests/engine/test_gemma4.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.testing.base import VOCAB_SIZE, write_tokenizer

WINDOW = 16
SPECIAL = 3  # tokens 0-2 are the tokenizer's special tokens: the permutation leaves them alone
PERMUTATION = np.concatenate([np.arange(SPECIAL), SPECIAL + np.random.default_rng(7).permutation(VOCAB_SIZE - SPECIAL)])


def _text_config(hidden: int, layers: int, *, softcap: float | None, tied: bool, init: float,
                 window: int = WINDOW, head_dim: int | None = None, vocab: int = VOCAB_SIZE) -> Any:
    """*head_dim*: an assistant's, which must be its target's (it attends into the target's keys)."""
    from transformers import Gemma4TextConfig

    kinds = ["sliding_attention", "full_attention"] * (layers // 2)
    heads = max(4, hidden // 64)
    head_dim = head_dim or hidden // heads
    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim,
        global_head_dim=2 * head_dim, sliding_window=window,  # type: ignore[call-arg]  # transformers 5 has it
        layer_types=kinds, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        final_logit_softcapping=softcap, max_position_embeddings=4096, num_kv_shared_layers=0,
        tie_word_embeddings=tied, initializer_range=init, eos_token_id=0, bos_token_id=1, pad_token_id=0)


def _save(model: Any, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def build_target(directory: Path, *, kind: str = "random", wrapper: bool = False, layers: int = 4,
                 hidden: int = 64, window: int = WINDOW, seed: int = 0) -> Path:
    """A Gemma 4 target: ``random`` (transformers' initialisation, widened so greedy text has no
    near-ties) or ``permutation``; ``gemma4_text``, or with *wrapper* the ``gemma4`` layout."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    permutation = kind == "permutation"
    text = _text_config(hidden, layers, softcap=None if permutation else 30.0, tied=not permutation, init=0.1,
                        window=window)
    if wrapper:
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None,
                                                            audio_config=None)).eval()
        language = model.model.language_model
        head = model.lm_head
    else:
        model = Gemma4ForCausalLM(text).eval()
        language, head = model.model, model.lm_head
    if permutation:
        with torch.no_grad():
            for layer in language.layers:  # small, not zero: the logits still depend on every layer
                layer.post_attention_layernorm.weight.mul_(0.05)  # (the norm after each block sets its scale)
                layer.post_feedforward_layernorm.weight.mul_(0.05)
            table = language.embed_tokens.weight
            head.weight.copy_(table[torch.as_tensor(np.argsort(PERMUTATION))])
    return _save(model, directory)


def build_assistant(directory: Path, target: Path, *, kind: str = "random", agreement: float = 1.0,
                    seed: int = 1, layers: int = 2) -> Path:
    """A Gemma 4 assistant for *target*: ``random``, ``agreeing`` with the permutation target (on
    *agreement* of the tokens), ``centroids`` (random, with the E2B/E4B centroid head: 16 clusters of
    32 tokens, the top 4 scored) or ``unified`` (random, ``gemma4_unified_assistant``)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4UnifiedAssistantConfig,
        Gemma4UnifiedAssistantForCausalLM,
    )

    torch.manual_seed(seed)
    target_text = json.loads((target / "config.json").read_text())
    target_text = target_text.get("text_config", target_text)
    backbone = target_text["hidden_size"]
    agreeing = kind == "agreeing"
    hidden = backbone if agreeing else backbone // 2
    text = _text_config(hidden, layers, softcap=None, tied=True, init=0.1, window=target_text["sliding_window"],
                        head_dim=target_text["head_dim"], vocab=target_text.get("vocab_size", VOCAB_SIZE))
    if kind == "unified":
        from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

        unified = Gemma4UnifiedTextConfig(**{k: v for k, v in text.to_dict().items()
                                             if k in Gemma4UnifiedTextConfig.__dataclass_fields__},
                                          global_head_dim=32)  # type: ignore[call-arg]
        model = Gemma4UnifiedAssistantForCausalLM(
            Gemma4UnifiedAssistantConfig(text_config=unified, backbone_hidden_size=backbone)).eval()
        return _finish(model, directory)
    extra: dict[str, Any] = {"use_ordered_embeddings": True, "num_centroids": 16, "centroid_intermediate_top_k": 4} \
        if kind == "centroids" else {}
    model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone,
                                                             **extra)).eval()
    if kind == "centroids":
        with torch.no_grad():
            ordering = np.random.default_rng(seed).permutation(VOCAB_SIZE)
            model.masked_embedding.token_ordering.copy_(torch.as_tensor(ordering))
    if agreeing:
        weights = load_file(str(next(target.glob("*.safetensors"))))
        table = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
        rows = np.argsort(PERMUTATION)  # row PERMUTATION[t] holds t's embedding
        rng = np.random.default_rng(seed)
        moved = rng.random(VOCAB_SIZE) >= agreement
        moved[:SPECIAL] = False
        rows[moved] = SPECIAL + rng.integers(0, VOCAB_SIZE - SPECIAL, int(moved.sum()))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.pre_projection.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, backbone)], dim=1))
            model.model.embed_tokens.weight.copy_(torch.as_tensor(table[rows]))
    return _finish(model, directory)


def _finish(model: Any, directory: Path) -> Path:
    out = _save(model, directory)
    config_path = out / "config.json"
    written = json.loads(config_path.read_text())
    written["block_size"] = 4  # as the published assistants' configs say
    config_path.write_text(json.dumps(written, indent=2))
    return out
