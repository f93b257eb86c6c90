"""Tiny Inkling checkpoints, built with transformers' own classes and ``save_pretrained``.

The layout is the published one: the ``inkling_mm_model`` wrapper config (text in ``text_config``)
and ``model.safetensors`` in the raw ``model.llm.*`` names with interleaved gate/up pairs, exactly
as transformers' reverse conversion writes them, plus tests/checkpoints.py's tokenizer (vocabulary
512; the head keeps 500 rows, so the vocabulary slice is exercised). The geometry reaches every
path: full and sliding layers with their own head counts, a window and a relative extent that a
32-token decode passes, the log scaling, one dense MLP and MoE layers with a shared expert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.checkpoints import VOCAB_SIZE, write_tokenizer

UNPADDED = 500
WINDOW = 8
EXTENT = 24


def text_config(*, mtp_layers: int | None = None, hidden: int = 64, layers: int = 4) -> dict[str, Any]:
    return dict(vocab_size=VOCAB_SIZE, unpadded_vocab_size=UNPADDED, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                swa_num_key_value_heads=4, swa_head_dim=hidden // 8, sliding_window_size=WINDOW, d_rel=4,
                rel_extent=EXTENT, log_scaling_n_floor=4, intermediate_size=96, moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                local_layer_ids=[i for i in range(layers) if i % 2], dense_mlp_idx=1, num_mtp_layers=mtp_layers,
                initializer_range=0.1, max_position_embeddings=4096, eos_token_id=2, bos_token_id=None)


def hf_config(**text: Any) -> Any:
    """transformers' ``InklingConfig``; the towers are the smallest transformers builds without scipy."""
    from transformers import InklingConfig

    return InklingConfig(text_config=text_config(**text),
                         vision_config=dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, patch_size=2,
                                            temporal_patch_size=2),
                         audio_config=dict(n_mel_bins=2, mel_vocab_size=4))


def build_target(directory: Path, *, seed: int = 0, **text: Any) -> Path:
    """A random Inkling target (transformers' initialisation, widened so greedy text has no near-ties)."""
    import torch
    from transformers import InklingForConditionalGeneration

    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(hf_config(**text)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sconv.conv1d.weight", "rel_logits_proj.proj", "gate.e_score_correction_bias")):
                param.normal_(0.0, 0.3)  # transformers starts these at 0-ish; make them matter
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def load_reference(directory: Path) -> Any:
    """transformers' model of *directory*, loaded back through its own conversion (the oracle)."""
    from transformers import InklingForConditionalGeneration

    return InklingForConditionalGeneration.from_pretrained(directory).eval()


def build_mtp(target: Path, *, seed: int = 5) -> Any:
    """Write *target*'s unindexed ``mtp.safetensors`` (``model.mtp.layers.N.*``, raw names) from a random
    transformers ``MtpModel`` over it; returns that ``MtpModel`` (the drafts' reference).

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
