"""GLM-4.7-Flash: the split drafter against an independent numpy reference of the DeepSeek-V3 MTP formula,
and the target adapter's logits against transformers'.

The reference reads the RAW tensors (``model.layers.{N}.*``: full ``kv_b_proj``,
per-expert MLPs) and computes, over a drafter sequence of S positions, with
MLA in its expanded (per-head keys and values) form, interleaved RoPE, causal
softmax attention, sigmoid routing whose correction bias only selects:

    x = eh_proj([rms(embed(t)) * enorm ; rms(h) * hnorm])
    x += o_proj(attention(rms(x) * ln_in));  x += moe(rms(x) * ln_post)
    draft = argmax(head(rms(x) * shared_head_norm)),  and x is the next step's h

The drafter under test is mlxcel's: split by ``mlxcel split-mtp``, loaded by
its loader, drafting as the burst does (catch-up, then chained drafts).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from mlxcel.checkpoints import inspect_checkpoint, inspect_drafter, load_drafter, speculative_target
from mlxcel.families.glm4_moe_lite.tiny import build_glm_checkpoint
from tests.server.conftest import mlxcel


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Interleaved rotary embedding of (S, ..., d) at positions 0..S-1: pairs (2i, 2i+1) rotate together."""
    d = x.shape[-1]
    angles = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d // 2,)
    cos, sin = np.cos(angles).reshape(shape), np.sin(angles).reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def reference(w: dict[str, np.ndarray], c: dict[str, object], tokens: list[int],
              hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits, block output) at every position of the drafter sequence (token t_i, target hidden h_i)."""
    eps, theta = float(c["rms_norm_eps"]), float(c["rope_theta"])  # type: ignore[arg-type]
    heads, nope, rope, v_dim, rank = (int(c[k]) for k in (  # type: ignore[call-overload]
        "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    seq = len(tokens)
    x = np.concatenate([_rms(w["embed_tokens.weight"][tokens], w["enorm.weight"], eps),
                        _rms(hidden, w["hnorm.weight"], eps)], axis=-1) @ w["eh_proj.weight"].T
    a = _rms(x, w["input_layernorm.weight"], eps)
    q = _rms(a @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], eps)
    q = (q @ w["self_attn.q_b_proj.weight"].T).reshape(seq, heads, nope + rope)
    compressed = a @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    latent = _rms(compressed[:, :rank], w["self_attn.kv_a_layernorm.weight"], eps)
    kv = (latent @ w["self_attn.kv_b_proj.weight"].T).reshape(seq, heads, nope + v_dim)
    q_pe, k_pe = _rope(q[..., nope:], theta), _rope(compressed[:, rank:], theta)
    scores = (np.einsum("ihd,jhd->hij", q[..., :nope], kv[..., :nope])
              + np.einsum("ihd,jd->hij", q_pe, k_pe)) * (nope + rope) ** -0.5
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attended = np.einsum("hij,jhd->ihd", p, kv[..., nope:]).reshape(seq, -1)
    x = x + attended @ w["self_attn.o_proj.weight"].T
    m = _rms(x, w["post_attention_layernorm.weight"], eps)
    top_k, scaling = int(c["num_experts_per_tok"]), float(c["routed_scaling_factor"])  # type: ignore[call-overload]
    experts = []
    for row in m:
        affinity = 1.0 / (1.0 + np.exp(-(w["mlp.gate.weight"] @ row)))
        chosen = np.argsort(-(affinity + w["mlp.gate.e_score_correction_bias"]))[:top_k]  # the bias only selects
        weights = affinity[chosen] / affinity[chosen].sum() * scaling
        experts.append(sum(s * w[f"mlp.experts.{e}.down_proj.weight"] @ (
            _silu(w[f"mlp.experts.{e}.gate_proj.weight"] @ row) * (w[f"mlp.experts.{e}.up_proj.weight"] @ row))
            for e, s in zip(chosen, weights, strict=True)))
    shared = (_silu(m @ w["mlp.shared_experts.gate_proj.weight"].T) * (m @ w["mlp.shared_experts.up_proj.weight"].T)
              ) @ w["mlp.shared_experts.down_proj.weight"].T
    x = x + np.stack(experts) + shared
    return _rms(x, w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T, x


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("glm-head")
    raw = build_glm_checkpoint(root / "glm-random", drafter="random", seed=3)
    result = mlxcel("split-mtp", "-m", str(raw), "-o", str(root / "glm-random-MTP"))
    assert result.returncode == 0, result.stderr
    return raw, root / "glm-random-MTP"


@pytest.mark.slow
def test_the_split_drafters_drafts_equal_the_reference(glm: tuple[Path, Path]) -> None:
    from mlx_lm import load

    raw, head_dir = glm
    config = json.loads((raw / "config.json").read_text())
    layer = f"model.layers.{config['num_hidden_layers']}."
    tensors = {k[len(layer):]: v.astype(np.float64) for file in sorted(raw.glob("model-*.safetensors"))
               for k, v in load_file(str(file)).items() if k.startswith(layer)}
    model, _ = load(str(raw))
    info = inspect_checkpoint(raw)
    spec = inspect_drafter(info, mtp=False, draft_model=head_dir)
    drafter = load_drafter(spec, info, model)
    rng = np.random.default_rng(0)
    drafts, expected = [], []
    for length in (1, 3, 6, 9):
        tokens = rng.integers(0, config["vocab_size"], size=length).tolist()
        hidden = rng.normal(size=(length, config["hidden_size"])).astype(np.float32)
        sequence = drafter.new_sequence([])
        sequence.catch_up(mx.array(hidden)[None], mx.array([tokens]))
        drafts.append(np.array(sequence.draft(3)).reshape(-1).tolist())
        chain, h = list(tokens), hidden.astype(np.float64)
        for _ in range(3):  # each draft feeds its token and the block's own output back
            logits, x = reference(tensors, config, chain, h)
            chain.append(int(np.argmax(logits[-1])))
            h = np.concatenate([h, x[-1:]])
        expected.append(chain[length:])
    assert drafts == expected
    assert len({t for d in expected for t in d}) > 4  # the inputs really vary the drafts


@pytest.mark.slow
def test_the_targets_forward_and_verify_logits_equal_transformers(glm: tuple[Path, Path]) -> None:
    import torch
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from transformers import AutoModelForCausalLM

    raw, _ = glm
    prompt = np.random.default_rng(1).integers(0, 512, size=20).tolist()
    reference_model = AutoModelForCausalLM.from_pretrained(str(raw), dtype=torch.float32)
    with torch.no_grad():
        expected = reference_model(torch.tensor([prompt])).logits[0].numpy()
    model, _ = load(str(raw))
    target = speculative_target("glm4_moe_lite", model)
    cache = make_prompt_cache(model)
    logits, _ = target.forward(mx.array([prompt[:-3]]), cache)
    verified = target.verify(mx.array([prompt[-3:]]), cache, "wide").logits  # row-wise MLA, the decode formula
    got = np.concatenate([np.array(logits[0]), np.array(verified[0])])
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=0)


@pytest.mark.slow
def test_the_probe_vetoes_mlx_lms_own_wide_forward_as_a_verify(glm: tuple[Path, Path], on_an_mlx_thread: None
                                                               ) -> None:
    """mlx-lm computes attention over a block in MLA's expanded form and a single token in the absorbed
    one: a K-wide forward is not the chain's bytes, which is why the adapter verifies row by row."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.exactness import probe_exactness
    from mlxcel.families.glm4_moe_lite.target import Glm4MoeLiteTarget
    from mlxcel.models.speculative import BlockVerify

    class WideForward(Glm4MoeLiteTarget):
        def verify(self, tokens: mx.array, cache: list[object], split: object) -> BlockVerify:
            logits, hidden = self.forward(tokens, cache)
            return BlockVerify(logits, hidden, tokens.shape[1])

    model, _ = load(str(glm[0]))
    def make_cache() -> list[object]:
        return make_prompt_cache(model)  # type: ignore[no-any-return]

    vetoed = probe_exactness(WideForward(model), model, make_cache, 3, 512, 4096)
    assert vetoed.split is None and "a width-2 verify at offset 12: position 0 differs" in (vetoed.detail or "")
    # Row by row, the probe finds a split that is exact (which one is the BLAS's business), on the MLX
    # thread, as the worker probes.
    assert probe_exactness(Glm4MoeLiteTarget(model), model, make_cache, 3, 512, 4096).split is not None
