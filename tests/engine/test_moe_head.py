"""The Qwen 3.6 MoE head's drafts against an independent numpy reference of its formula.

The reference reads the raw Hugging Face tensors itself (zero-centred norms,
fused experts) and computes, for a head sequence of one position (where
attention over the single key is that key's value, whatever the rotary
embedding):

    x = fc([rms(embed(t)) ; rms(h)]);  x += o(v * sigmoid(gate));  x += moe(rms(x))
    draft = argmax(lm_head(rms(x)))

with moe = the normalised top-k softmax mixture of SwiGLU experts plus the
sigmoid-gated shared expert. The head under test is mlxcel's, loaded through
its own loader (``stack_experts``, the norm shift) and drafting as the burst does.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from safetensors.numpy import load_file

from mlxcel.checkpoints import inspect_checkpoint, load_drafter
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.drafters import DrafterSpec


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * (1.0 + weight)  # Hugging Face's zero-centred weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def reference_draft(raw: dict[str, np.ndarray], text: dict[str, object], token: int, hidden: np.ndarray) -> int:
    eps, heads, kv_heads, head_dim = (float(text["rms_norm_eps"]), int(text["num_attention_heads"]),  # type: ignore[arg-type]
                                      int(text["num_key_value_heads"]), int(text["head_dim"]))  # type: ignore[arg-type]
    top_k = int(text["num_experts_per_tok"])  # type: ignore[arg-type]
    w = {k[len("mtp."):]: v.astype(np.float64) for k, v in raw.items() if k.startswith("mtp.")}
    embed = raw["model.language_model.embed_tokens.weight"].astype(np.float64)
    x = w["fc.weight"] @ np.concatenate([_rms(embed[token], w["pre_fc_norm_embedding.weight"], eps),
                                         _rms(hidden, w["pre_fc_norm_hidden.weight"], eps)])
    layer = "layers.0."
    normed = _rms(x, w[layer + "input_layernorm.weight"], eps)
    q = (w[layer + "self_attn.q_proj.weight"] @ normed).reshape(heads, 2 * head_dim)
    gate = q[:, head_dim:].reshape(-1)
    values = (w[layer + "self_attn.v_proj.weight"] @ normed).reshape(kv_heads, head_dim)
    attended = np.concatenate([values[i // (heads // kv_heads)] for i in range(heads)])  # one key: its value
    x = x + w[layer + "self_attn.o_proj.weight"] @ (attended * _sigmoid(gate))
    normed = _rms(x, w[layer + "post_attention_layernorm.weight"], eps)
    logits = w[layer + "mlp.gate.weight"] @ normed
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(probs)[-top_k:]
    scores = probs[chosen] / probs[chosen].sum()
    gate_up, down = w[layer + "mlp.experts.gate_up_proj"], w[layer + "mlp.experts.down_proj"]
    middle = gate_up.shape[1] // 2
    mixture = sum(s * down[e] @ (_silu(gate_up[e, :middle] @ normed) * (gate_up[e, middle:] @ normed))
                  for e, s in zip(chosen, scores, strict=True))
    shared = w[layer + "mlp.shared_expert.down_proj.weight"] @ (
        _silu(w[layer + "mlp.shared_expert.gate_proj.weight"] @ normed)
        * (w[layer + "mlp.shared_expert.up_proj.weight"] @ normed))
    x = x + mixture + _sigmoid(w[layer + "mlp.shared_expert_gate.weight"] @ normed) * shared
    out = _rms(x, w["norm.weight"], eps)
    return int(np.argmax(raw["lm_head.weight"].astype(np.float64) @ out))


@pytest.mark.slow
def test_the_moe_heads_drafts_equal_the_reference(tmp_path: Path) -> None:
    path = build_mtp_checkpoint(tmp_path / "qwen36-moe", drafter="random", moe=True)
    raw = load_file(str(path / "model.safetensors"))
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in raw  # fused, as Hugging Face stores them
    text = json.loads((path / "config.json").read_text())["text_config"]
    model, _ = load(str(path))
    spec = DrafterSpec(path=path, name="qwen36-moe#mtp", in_checkpoint=True, model_type="qwen3_5_moe")
    head = load_drafter(spec, inspect_checkpoint(path), model)
    rng = np.random.default_rng(0)
    drafts, expected = [], []
    for _ in range(12):
        token = int(rng.integers(0, 512))
        hidden = rng.normal(size=(text["hidden_size"],)).astype(np.float32)
        sequence = head.new_sequence([])  # a fresh head: one position, as the reference assumes
        sequence.catch_up(mx.array(hidden)[None, None], mx.array([[token]]))
        drafts.append(int(sequence.draft(1).item()))
        expected.append(reference_draft(raw, text, token, hidden.astype(np.float64)))
    assert drafts == expected
    assert len(set(expected)) > 3  # the inputs really vary the draft
