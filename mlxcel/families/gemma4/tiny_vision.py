"""A tiny Gemma 4 vision-language checkpoint, built with transformers' own classes (tests only: needs torch).

``Gemma4ForConditionalGeneration`` with random weights (every parameter drawn, the vision tower's position table
and standardization too: their defaults would make an image's position and scale invisible), saved as a user's
download holds it: ``config.json`` (with ``global_head_dim`` and a top-level ``vocab_size``, which the MLX
loaders read and transformers 5 writes elsewhere), ``model.safetensors``, ``preprocessor_config.json`` (Gemma 4's
image processor: patch 4, pooling 3, at most 70 soft tokens an image) and a Gemma tokenizer holding Gemma 4's
image markers, with a chat template that writes ``<|image|>`` where a message has an image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Gemma 4's marker tokens, spelled as its tokenizer spells them.
MARKERS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
           "boa_token": "<|audio>", "eoa_token": "<audio|>", "video_token": "<|video|>", "sot_token": "<|turn>",
           "eot_token": "<turn|>"}
PATCH, POOLING, MAX_SOFT_TOKENS = 4, 3, 70
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' -%}<|image|>{%- elif c['type'] == 'text' -%}{{ c['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<turn|>\n{%- endfor -%}{%- if add_generation_prompt -%}<|turn>model\n{%- endif -%}"
)


def vocabulary() -> dict[str, int]:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!:;'\"-()\n":
        vocab.setdefault(piece, len(vocab))
    for marker in MARKERS.values():
        vocab[marker] = len(vocab)
    return vocab


def build_vision_checkpoint(directory: Path, *, bidirectional: bool = True, seed: int = 0,
                            text_sizes: dict[str, Any] | None = None, vision_sizes: dict[str, Any] | None = None,
                            max_soft_tokens: int = MAX_SOFT_TOKENS) -> Path:
    """Write the tiny checkpoint into *directory*; *bidirectional*: the text model's sliding layers see a whole
    image at once (``use_bidirectional_attention: "vision"``, as Gemma 4 12B and larger), else plain causal.
    *text_sizes*, *vision_sizes*, *max_soft_tokens*: a bigger model (a benchmark's)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil, GemmaTokenizer

    torch.manual_seed(seed)
    vocab = vocabulary()
    tokenizer = GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=False, extra_special_tokens=MARKERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {name: vocab[text] for name, text in MARKERS.items()}
    text: dict[str, Any] = {
        "vocab_size": len(vocab), "vocab_size_per_layer_input": len(vocab), "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
        "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0, "sliding_window": 32,
        "max_position_embeddings": 2048, "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": "vision" if bidirectional else None, "use_double_wide_mlp": False,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, **(text_sizes or {})}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "patch_size": PATCH, "pooling_kernel_size": POOLING,
              "position_embedding_size": 64, "standardize": True,
              "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}, **(vision_sizes or {})}
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          image_token_id=ids["image_token"], boi_token_id=ids["boi_token"],
                          eoi_token_id=ids["eoi_token"], video_token_id=ids["video_token"],
                          audio_token_id=ids["audio_token"], boa_token_id=ids["boa_token"],
                          eoa_token_index=ids["eoa_token"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            elif "position_embedding_table" in name:
                parameter.normal_(0.0, 0.5)
            else:
                parameter.normal_(0.0, 0.05)
        tower = model.model.vision_tower
        tower.std_bias.normal_(0.0, 0.1)
        tower.std_scale.copy_(1.0 + 0.1 * torch.randn_like(tower.std_scale))
    model.tie_weights()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    written["text_config"]["global_head_dim"] = text["global_head_dim"]
    written["vocab_size"] = len(vocab)
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    images = Gemma4ImageProcessorPil(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
                                     max_soft_tokens=max_soft_tokens)
    images.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # What a download holds beside them (mlx-vlm's processor reads it).
    (directory / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": max_soft_tokens, "audio_seq_length": 750,
        "audio_ms_per_token": 40, "image_processor": images.to_dict()}, indent=2))
    return directory
