"""Tiny checkpoints in the real Hugging Face layout, built by the tests themselves.

No model hub is reachable, so each family gets a few-layer model with random
weights (fixed seed) and a real byte-level BPE tokenizer trained with the
`tokenizers` library on a few files of the Python standard library. The files
are what a user's download would hold: ``config.json``, ``model.safetensors``
(tensor names and layouts as Hugging Face stores them), ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOOLS_TURN = (
    # The tools as JSON in a system turn, in the Hermes / Qwen 2.5 manner.
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n"
    "{%- endfor %}</tools>\nCall a function as <tool_call>{\"name\": <name>, \"arguments\": <object>}"
    "</tool_call><|im_end|>\n{% endif %}"
)
_CALLS = (
    # An assistant's calls as <tool_call>{json}</tool_call>: mlx-lm reads "<tool_call>" and "tool_call.name"
    # in a template as its json_tools format.
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "</tool_call>{%- endfor %}"
)
_TOOL_RESULT = "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
TOOLS_CHATML = (
    # ChatML with tools, in the Hermes / Qwen 2.5 manner: tool results in <tool_response>.
    _TOOLS_TURN +
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    + _CALLS + "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULT +
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_CHATML = (
    # ChatML with tools as Qwen 3.5 thinks: the generation prompt opens a <think> block unless
    # enable_thinking is false (mlx-lm passes true for a vocabulary with the markers); an assistant's
    # earlier reasoning_content is rendered back in its own block.
    _TOOLS_TURN +
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}" + _TOOL_RESULT + "{% else %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' and message.reasoning_content %}<think>\n{{ message.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ message.content }}" + _CALLS + "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512

_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {**_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "qwen3_5": {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {
            **_COMMON,
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
        },
    },
}
FAMILIES = tuple(CONFIGS)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "glob.py")]


def write_tokenizer(directory: Path, chat_template: str = CHATML, added: tuple[str, ...] = (),
                    vocab_size: int = VOCAB_SIZE, model_max_length: int = 4096) -> None:
    """A byte-level BPE tokenizer of *vocab_size* tokens, then *added*: extra tokens (not special: they decode
    as their text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if added:
        tokenizer.add_tokens(list(added))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": chat_template,
        "model_max_length": model_max_length,  # the model's context window, as a real checkpoint's says
    }, indent=2))


def _to_hf_qwen3_5(weights: dict[str, Any]) -> dict[str, Any]:
    """Undo mlx-lm's qwen3_5 sanitize: HF names, conv1d as (C, 1, K), zero-centred norms."""
    import mlx.core as mx

    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        hf = name.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head", "lm_head")
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        elif value.ndim == 1 and name.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                                                "model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
            value = value - 1.0
        out[hf] = value
    return out


def _fuse_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's switch MLP back to Hugging Face's fused experts (what qwen3_5_moe's sanitize undoes)."""
    import mlx.core as mx

    out = dict(weights)
    for name in [n for n in weights if n.endswith(".switch_mlp.gate_proj.weight")]:
        prefix = name[:-len(".switch_mlp.gate_proj.weight")]
        gate, up = out.pop(name), out.pop(f"{prefix}.switch_mlp.up_proj.weight")
        out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight")
    return out


_TO_HF: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"qwen3_5": _to_hf_qwen3_5}


def build_checkpoint(directory: Path, family: str, seed: int = 0, scale: float = 1.0,
                     chat_template: str = CHATML, markers: tuple[str, ...] = (), **overrides: Any) -> Path:
    """Write a tiny *family* checkpoint into *directory* (created) and return it.

    *scale* multiplies the random weights: larger values give peakier output
    distributions, so greedy decoding has no near-ties. *markers*: tokens of the
    vocabulary mlx-lm reads a model's formats from (``<think>``, ...), within its
    size. *overrides*: config values on top of the family's (a bigger model for a benchmark).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    directory.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[family], **overrides}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    from mlxcel.models.loader import context_length

    write_tokenizer(directory, chat_template, added=markers, vocab_size=VOCAB_SIZE - len(markers),
                    model_max_length=context_length(config))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {name: (v * scale if v.ndim > 1 else v) for name, v in weights.items()}
    weights = _TO_HF.get(family, lambda w: w)(weights)
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    return directory


def build_mtp_checkpoint(directory: Path, *, drafter: str = "random", layers: int = 4, hidden: int = 64,
                         context_scale: float = 1.0, raw: bool = True, seed: int = 0, moe: bool = False,
                         positions: int = 4096, head_dim: int | None = None) -> Path:
    """A tiny Qwen 3.5 target with an in-checkpoint ``mtp.*`` head.

    *drafter* ``random``: a random head, whose drafts the target rarely accepts.
    ``aligned``: the head predicts what the target will say. The target's
    sublayer outputs are scaled by *context_scale*; at 0 the next token is a
    fixed function f of the current one, and the aligned head, which reads
    only the embedding of the token it is given and applies the same LM head,
    predicts f of it: the token after next, always. Small non-zero scales give
    a target that mostly, not always, agrees with it.

    *raw*: the Hugging Face layout (zero-centred norms, conv1d as (C, 1, K));
    otherwise the layout mlx-lm's converter writes. *positions*: its context window. *head_dim*: its full
    attention's (16 by default; a quantized KV cache needs a multiple of 64).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxcel.families.qwen3_5.mtp import Qwen35MTP, text_args

    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(CONFIGS["qwen3_5"]))
    text = config["text_config"]
    text.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                num_attention_heads=max(1, hidden // 16), num_key_value_heads=max(1, hidden // 32),
                max_position_embeddings=positions)
    if head_dim is not None:
        text["head_dim"] = head_dim
    config["mtp_num_hidden_layers"] = 1
    if moe:  # Qwen 3.6: every MLP (the head's included) a mixture of experts with a shared expert
        config["model_type"], text["model_type"] = "qwen3_5_moe", "qwen3_5_moe_text"
        config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                    shared_expert_intermediate_size=hidden, norm_topk_prob=True, decoder_sparse_step=1)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, model_max_length=positions)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    head = Qwen35MTP(text_args(config), num_layers=1)
    outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    target = {name: (v * 2.0 if v.ndim > 1 else v) for name, v in leaves}
    target = {name: (v * context_scale if name.endswith(outputs) else v) for name, v in target.items()}
    head_leaves: list[tuple[str, Any]] = tree_flatten(head.parameters())  # type: ignore[assignment]
    mtp = {name: (v * 2.0 if v.ndim > 1 else v) for name, v in head_leaves}
    if drafter == "aligned":
        eye = mx.eye(hidden)
        mtp["fc.weight"] = mx.concatenate([eye, mx.zeros((hidden, hidden))], axis=1)
        mtp = {name: (mx.zeros_like(v) if name.endswith(outputs) else v) for name, v in mtp.items()}
    if raw:
        target = _fuse_experts(_to_hf_qwen3_5(target))
        mtp = _fuse_experts({name: (v - 1.0 if v.ndim == 1 and "norm" in name else v) for name, v in mtp.items()})
    weights = {**target, **{f"mtp.{name}": v for name, v in mtp.items()}}
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    return directory


def write_weight_index(directory: Path) -> Path:
    """Add ``model.safetensors.index.json`` (every tensor -> its file), as a sharded Hugging Face checkpoint has.

    mlx-lm's pipeline loading reads it to pick each rank's files.
    """
    import mlx.core as mx

    weight_map = {name: file.name for file in sorted(directory.glob("model*.safetensors"))
                  for name in mx.load(str(file))}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return directory
