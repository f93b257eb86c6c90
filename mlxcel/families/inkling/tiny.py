"""Tiny Inkling checkpoints, built with transformers' own classes and ``save_pretrained``.

The layout is the published one: the ``inkling_mm_model`` wrapper config (text in ``text_config``)
and ``model.safetensors`` in the raw ``model.llm.*`` names with interleaved gate/up pairs, exactly
as transformers' reverse conversion writes them, plus mlxcel/testing/base.py's tokenizer (vocabulary
512; the head keeps 500 rows, so the vocabulary slice is exercised). The geometry reaches every
path: full and sliding layers with their own head counts, a window and a relative extent that a
32-token decode passes, the log scaling, one dense MLP and MoE layers with a shared expert.

Besides random models, a pairing whose MTP head agrees with its target by construction (as
mlxcel/families/gemma4/tiny.py builds Gemma's):

- the *permutation target*: every attention and MLP output projection scaled down, so the residual
  stream is mostly the token's own (normalised) embedding, and an untied head whose row
  ``PERMUTATION[t]`` is token ``t``'s embedding: the next token is ``PERMUTATION[current]``, whatever
  came before (``PERMUTATION`` moves only the unpadded, non-special tokens);
- the *agreeing head*: its blocks add nothing (attention and MLP output projections zero) and its
  ``input_proj`` passes the embedding half through, so a block's output is the normalised embedding
  of its input token and the target's head reads from it the token after next.

Both agreements are checked inside transformers by tests/engine/test_inkling_mtp.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.testing.base import VOCAB_SIZE, write_tokenizer

UNPADDED = 500
WINDOW = 8
EXTENT = 24
SPECIAL = 3  # tokens 0-2 are the tokenizer's special tokens (2 ends a sequence): left alone
PERMUTATION = np.concatenate([np.arange(SPECIAL), SPECIAL + np.random.default_rng(7).permutation(UNPADDED - SPECIAL),
                              np.arange(UNPADDED, VOCAB_SIZE)])
SHRINK = 0.02  # the permutation target's output projections: small, not zero (every layer still counts)


def text_config(*, mtp_layers: int | None = None, hidden: int = 64, layers: int = 4,
                **overrides: Any) -> dict[str, Any]:
    """*overrides*: any other ``InklingTextConfig`` field (a benchmark's geometry)."""
    return dict(vocab_size=VOCAB_SIZE, unpadded_vocab_size=UNPADDED, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                swa_num_key_value_heads=4, swa_head_dim=hidden // 8, sliding_window_size=WINDOW, d_rel=4,
                rel_extent=EXTENT, log_scaling_n_floor=4, intermediate_size=96, moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                local_layer_ids=[i for i in range(layers) if i % 2], dense_mlp_idx=1, num_mtp_layers=mtp_layers,
                initializer_range=0.1, max_position_embeddings=4096, eos_token_id=2, bos_token_id=None) | overrides


def hf_config(**text: Any) -> Any:
    """transformers' ``InklingConfig``; the towers are the smallest transformers builds without scipy."""
    from transformers import InklingConfig

    return InklingConfig(text_config=text_config(**text),
                         vision_config=dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, patch_size=2,
                                            temporal_patch_size=2),
                         audio_config=dict(n_mel_bins=2, mel_vocab_size=4))


def build_target(directory: Path, *, kind: str = "random", seed: int = 0, **text: Any) -> Path:
    """An Inkling target: ``random`` (transformers' initialisation, widened so greedy text has no
    near-ties) or ``permutation`` (see the module docstring)."""
    import torch
    from transformers import InklingForConditionalGeneration

    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(hf_config(**text)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sconv.conv1d.weight", "rel_logits_proj.proj", "gate.e_score_correction_bias")):
                param.normal_(0.0, 0.3)  # transformers starts these at 0-ish; make them matter
            if kind == "random" and name == "model.language_model.norm.weight":
                param.normal_(1.0, 0.3)  # not all ones, or an MTP head's greedy draft would not see it
            if kind == "permutation" and name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                param.mul_(SHRINK)
        if kind == "permutation":
            table = model.model.language_model.embed_tokens.weight
            model.lm_head.weight.copy_(table[torch.as_tensor(np.argsort(PERMUTATION))])
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def load_reference(directory: Path) -> Any:
    """transformers' model of *directory*, loaded back through its own conversion (the oracle)."""
    from transformers import InklingForConditionalGeneration

    return InklingForConditionalGeneration.from_pretrained(directory).eval()


def build_mtp(target: Path, *, kind: str = "random", seed: int = 5) -> Any:
    """Write *target*'s unindexed ``mtp.safetensors`` (``model.mtp.layers.N.*``, raw names) from a
    transformers ``MtpModel`` over it, ``random`` or ``agreeing`` (with the permutation target; see the
    module docstring); returns that ``MtpModel`` (the drafts' reference).

    The blocks' raw tensor names and interleaving are transformers' own: each block is put into the
    target's dense, full-attention layer 0 and written by ``save_pretrained``'s reverse conversion.
    """
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    hf = load_reference(target)
    torch.manual_seed(seed)
    mtp = MtpModel(hf, hf.config.text_config.num_mtp_layers).eval()
    raw: dict[str, Any] = {}
    with torch.no_grad():
        for name, param in mtp.named_parameters():
            if name.endswith(("sconv.conv1d.weight", "rel_logits_proj.proj")):
                param.normal_(0.0, 0.3)
        if kind == "agreeing":
            width = hf.config.text_config.hidden_size
            for layer in mtp.layers:  # hidden first in the concat: keep the second (embedding) half
                layer.mtp_block.self_attn.o_proj.weight.zero_()
                layer.mtp_block.mlp.down_proj.weight.zero_()
                layer.eh_proj.weight.copy_(torch.cat([torch.zeros(width, width), torch.eye(width)], dim=1))
        for k, layer in enumerate(mtp.layers):
            carrier = copy.deepcopy(hf)
            carrier.model.language_model.layers[0].load_state_dict(layer.mtp_block.state_dict())
            with tempfile.TemporaryDirectory() as scratch:
                carrier.save_pretrained(scratch, safe_serialization=True)
                written = load_file(str(Path(scratch) / "model.safetensors"))
            for name, value in written.items():
                if name.startswith("model.llm.layers.0."):
                    raw[f"model.mtp.layers.{k}.transformer_block.{name.removeprefix('model.llm.layers.0.')}"] = value
            for ours, theirs in (("embed_norm", layer.enorm), ("hidden_norm", layer.hnorm),
                                 ("input_proj", layer.eh_proj)):
                raw[f"model.mtp.layers.{k}.{ours}.weight"] = theirs.weight.detach().clone().contiguous()
    save_file(raw, str(target / "mtp.safetensors"))
    return mtp
