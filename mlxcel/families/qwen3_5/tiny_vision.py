"""A tiny Qwen 3.5 vision-language checkpoint, built with transformers' own classes (tests only: needs torch).

``Qwen3_5ForConditionalGeneration`` (``Qwen3_5MoeForConditionalGeneration`` with *moe*) with random weights (every
parameter drawn: the zero-centred norms and the vision tower's position table too), saved as a user's download
holds it: ``config.json`` (with ``full_attention_interval``, which the MLX loaders read and transformers 5 turns
into ``layer_types``), ``model.safetensors`` (the tower as ``model.visual.*``, a MoE's experts fused; with *mtp*, an
``mtp.*`` head as Qwen 3.5's checkpoints hold one), ``preprocessor_config.json`` (Qwen 3.5's image processor:
patch 16, merge 2, 4 to 64 image tokens), ``processor_config.json`` and ``chat_template.jinja`` (what
``AutoProcessor`` reads, given torchvision) and the tiny checkpoints' byte-level tokenizer
(:func:`mlxcel.testing.base.write_tokenizer`) with Qwen's vision markers, splitting text as transformers'
``Qwen3_5Tokenizer`` does, its ChatML template writing ``<|vision_start|><|image_pad|><|vision_end|>`` where a
message has an image."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel.testing.base import TOOL_CALLS, TOOLS_TURN, VOCAB_SIZE, write_tokenizer

#: Qwen's vision markers, added after the tiny vocabulary (ids 512 on).
MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, MERGE, TEMPORAL_PATCH = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 4 * (PATCH * MERGE) ** 2, 64 * (PATCH * MERGE) ** 2  # 4 to 64 image tokens
_CONTENT = (  # a message's text, or its parts in order: an image part becomes the vision markers
    "{% if message['content'] is string %}{{ message['content'] }}{% elif message['content'] %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (  # ChatML with tools as Qwen 3.5's: a tool's result (a screenshot too) in a user turn
    TOOLS_TURN + "{% for message in messages %}{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>"
    + _CONTENT + "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n" + _CONTENT
    + TOOL_CALLS + "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def _draw(name: str, parameter: Any) -> None:
    """A random value for *parameter* that leaves nothing degenerate (norms near their initial 0 or 1)."""
    import torch

    if parameter.ndim == 1 and "norm" in name:
        parameter.copy_(parameter + 0.1 * torch.randn_like(parameter))
    elif "pos_embed" in name:
        parameter.normal_(0.0, 0.5)
    else:
        parameter.normal_(0.0, 0.05)


def build_vision_checkpoint(directory: Path, *, moe: bool = False, seed: int = 0,
                            text_sizes: dict[str, Any] | None = None, vision_sizes: dict[str, Any] | None = None,
                            mtp: bool = False, pixels: tuple[int, int] = (MIN_PIXELS, MAX_PIXELS)) -> Path:
    """Write the tiny checkpoint into *directory*: four text layers (three linear-attention, one full), a two-block
    vision tower. *moe*: Qwen 3.6's mixture-of-experts MLPs. *mtp*: a one-layer MTP head beside (``--mtp``).
    *text_sizes*, *vision_sizes*, *pixels* (the image processor's least and most pixels): a bigger model (a
    benchmark's)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    if moe:
        from transformers import Qwen3_5MoeConfig as Config
        from transformers import Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3_5Config as Config  # type: ignore[assignment]
        from transformers import Qwen3_5ForConditionalGeneration as Model  # type: ignore[assignment]

    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    ids = {marker: VOCAB_SIZE + i for i, marker in enumerate(MARKERS)}
    text: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE + len(MARKERS), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "full_attention_interval": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 0,
        # rotary dims 0.25 x 32 = 8: 4 frequencies, interleaved over time, rows and columns as [2, 1, 1]
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1)
    text.update(text_sizes or {})
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
              "temporal_patch_size": TEMPORAL_PATCH, "spatial_merge_size": MERGE, "num_position_embeddings": 64,
              "out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": [], **(vision_sizes or {})}
    config = Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                    image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                    vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = Model(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            _draw(name, parameter)
    model.save_pretrained(directory)
    written = json.loads((directory / "config.json").read_text())
    written["text_config"]["full_attention_interval"] = text["full_attention_interval"]
    # The model's own names: transformers 5 saves a MoE's experts one by one, mlx-lm reads them fused (as Qwen's).
    weights = {name: value.detach().contiguous() for name, value in model.state_dict().items()}
    if mtp:  # Qwen 3.5's head, as its checkpoints hold it: a full-attention layer of the model's own, norms, fc
        written["text_config"]["mtp_num_hidden_layers"] = 1
        hidden, full = text["hidden_size"], model.config.text_config.layer_types.index("full_attention")
        layer = type(model.model.language_model.layers[full])(model.config.text_config, full)
        head = {f"layers.0.{name}": value.detach().clone() for name, value in layer.named_parameters()}
        head.update({f"{norm}.weight": torch.zeros(hidden) for norm in ("pre_fc_norm_embedding",
                                                                         "pre_fc_norm_hidden", "norm")})
        head["fc.weight"] = torch.empty(hidden, 2 * hidden)
        with torch.no_grad():
            for name, parameter in head.items():
                _draw(name, parameter)
        weights.update({f"mtp.{name}": value.contiguous() for name, value in head.items()})
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    write_tokenizer(directory, chat_template=CHAT_TEMPLATE, added=MARKERS,
                    model_max_length=text["max_position_embeddings"])
    # Split text as transformers' Qwen3_5Tokenizer does (AutoTokenizer rebuilds it so), markers special as Qwen's.
    qwen = json.loads(AutoTokenizer.from_pretrained(directory).backend_tokenizer.to_str())
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer.update(normalizer=qwen["normalizer"], pre_tokenizer=qwen["pre_tokenizer"])
    for token in tokenizer["added_tokens"]:
        token["special"] = token["special"] or token["content"] in MARKERS
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False))
    images = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE,
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                      size={"shortest_edge": pixels[0], "longest_edge": pixels[1]})
    images.save_pretrained(directory)
    # What AutoProcessor reads (its chat template too; it needs torchvision, for Qwen3VLProcessor's video processor).
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory
