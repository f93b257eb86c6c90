"""Inkling (thinkingmachines), text only: mlxcel's own model file, as mlx-lm writes one.

mlx-lm has no Inkling; this is written from transformers' ``models/inkling`` (the parity oracle of
``tests/engine/test_inkling.py``). A decoder layer is pre-norm attention and MLP, each followed by a
short causal depthwise convolution with a residual (``attn_sconv``, ``mlp_sconv``); the attention
convolves its keys and values too (``k_sconv``, ``v_sconv``), RMS-normalises q and k per head (so the
scale is 1/d), and adds a learned relative-position bias: each query's ``r_proj`` state mixes a bank of
bias-versus-distance profiles (``rel_logits_proj.proj``), zero beyond ``rel_extent`` keys back. There
is no rotary embedding. Full-attention layers may scale queries and bias up logarithmically with the
position; sliding layers have their own head geometry and window. MLPs are dense (the first
``dense_mlp_idx`` layers) or a sigmoid-routed MoE whose shared experts sit in the router's softmax.
The embedding is RMS-normalised; the head divides by ``logits_mup_width_multiplier`` and drops the
padded vocabulary rows past ``unpadded_vocab_size``.

Caches: each layer's :class:`InklingCache` holds its keys/values and the four convolutions' last
``kernel - 1`` inputs. They do not merge into mlx-lm's batch (no ``merge``), so the engine serves
Inkling one sequence at a time; a left-padded batch would need the convolutions masked at the
padding and per-sequence positions for the log scaling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, _BaseCache
from mlx_lm.models.switch_layers import SwitchGLU

from .weights import remap_layer_weights

#: Elements of one attention block's bias and scores (b x heads x queries x keys): 2^24 float32, 64 MiB.
#: At 64 heads and 32k keys a 512-token chunk's would be 1 Gi elements, in each of several tensors.
SCORE_BUDGET = 1 << 24

TYPES = frozenset({"inkling_mm_model", "inkling_text"})

#: config.json names transformers reads as others (its ``InklingTextConfig.attribute_map``).
_ALIASES = {"embedding_multiplier": "logits_mup_width_multiplier", "sliding_window": "sliding_window_size",
            "num_local_experts": "n_routed_experts", "sconv_kernel_size": "conv_kernel_size",
            "model_max_length": "max_position_embeddings"}


@dataclass
class ModelArgs:
    model_type: str = "inkling_mm_model"
    vocab_size: int = 201024
    unpadded_vocab_size: int | None = None
    hidden_size: int = 6144
    num_hidden_layers: int = 66
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 64
    swa_num_key_value_heads: int = 16
    swa_head_dim: int = 128
    sliding_window_size: int = 512
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    local_layer_ids: list[int] | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    dense_mlp_idx: int = 0
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    intermediate_size: int = 24576
    dense_intermediate_size: int | None = None
    moe_intermediate_size: int = 3072
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    route_scale: float = 8.0
    logits_mup_width_multiplier: float = 24.0
    max_position_embeddings: int = 131072
    num_mtp_layers: int | None = None
    mtp_local_layer_ids: list[int] | None = None
    mtp_hidden_states_first: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """From ``config.json``: the ``inkling_mm_model`` wrapper (text in ``text_config``, MTP in
        ``mtp_config``) or a bare ``inkling_text`` config."""
        text = dict(config.get("text_config") or config)
        for old, new in _ALIASES.items():
            if old in text and new not in text:
                text[new] = text.pop(old)
        mtp = config.get("mtp_config") or {}
        text.setdefault("num_mtp_layers", mtp.get("num_nextn_predict_layers"))
        text.setdefault("mtp_local_layer_ids", mtp.get("local_layer_ids"))
        if text.get("dense_intermediate_size") is not None:
            # Then intermediate_size is the routed experts' width (transformers' reading, #49416).
            text["moe_intermediate_size"] = text["intermediate_size"]
            text["intermediate_size"] = text["dense_intermediate_size"]
        names = {f.name for f in dataclasses.fields(cls)}
        args = cls(**{k: v for k, v in text.items() if k in names and k != "extra"})
        args.model_type = config.get("model_type", args.model_type)
        n = args.num_hidden_layers
        if args.layer_types is None:
            default = {i for i in range(n) if (i + 1) % 6}  # five sliding layers, then a full one
            local = set(args.local_layer_ids) if args.local_layer_ids is not None else default
            args.layer_types = ["hybrid_sliding" if i in local else "hybrid" for i in range(n)]
        if args.mlp_layer_types is None:
            args.mlp_layer_types = ["dense" if i < args.dense_mlp_idx else "sparse" for i in range(n)]
        return args


class InklingCache(_BaseCache):
    """One layer's keys/values and its four convolution states (``kernel - 1`` last inputs each, float32).

    Not trimmable (a convolution state cannot be rewound by a count) and without ``merge``: see the
    module docstring. The speculative target rewinds it itself, from the states a verify kept.
    """

    CONVS = ("k", "v", "attn", "mlp")

    def __init__(self) -> None:
        self.kv = KVCache()
        self.conv: dict[str, mx.array | None] = dict.fromkeys(self.CONVS)
        #: While a speculative verify runs: each convolution's whole input (state, then the block),
        #: from which ``InklingTarget.rollback`` takes the state after any prefix of the block.
        self.windows: dict[str, mx.array] | None = None

    @property
    def offset(self) -> int:
        return self.kv.offset

    @property
    def state(self) -> list[Any]:
        return [*self.kv.state, *(self.conv[name] for name in self.CONVS)]

    @state.setter
    def state(self, value: list[Any]) -> None:
        # Whole: mlx-lm's ``from_state`` (a prompt cache file's) sets it on an instance never initialised.
        self.kv, self.windows, split = KVCache(), None, len(value) - len(self.CONVS)
        self.kv.state = value[:split]  # the key/value cache's state is mlx-lm's to shape
        self.conv = dict(zip(self.CONVS, value[split:], strict=True))

    def live_state(self) -> list[Any]:
        """What a later step reads: the keys/values so far and the convolution states."""
        kv = self.kv
        live = [] if kv.keys is None else [kv.keys[..., :kv.offset, :], kv.values[..., :kv.offset, :]]
        return live + [c for c in self.conv.values() if c is not None]

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.kv.keys is None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(c.nbytes for c in self.conv.values() if c is not None)


class ShortConv(nn.Module):
    """``x + causal_depthwise_conv(x)`` over the sequence, in float32 (as transformers keeps it).

    ``weight`` is (kernel, channels). With a cache, the inputs are its state followed by *x*, and
    the state becomes the last ``kernel - 1`` of them; ``window`` (if given) receives that whole
    input, from which a speculative rollback slices the state after any prefix of *x*.
    """

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = mx.zeros((kernel, channels))

    def __call__(self, x: mx.array, cache: InklingCache | None, name: str) -> mx.array:
        kernel, length = self.weight.shape[0], x.shape[1]
        xf = x.astype(mx.float32)
        state = cache.conv[name] if cache is not None else None
        if state is None:
            state = mx.zeros((x.shape[0], kernel - 1, x.shape[2]), mx.float32)
        window = mx.concatenate([state, xf], axis=1)
        if cache is not None:
            cache.conv[name] = window[:, -(kernel - 1):, :]
            if cache.windows is not None:  # a verify: keep every input (a half split calls twice)
                seen = cache.windows.get(name)
                cache.windows[name] = window if seen is None else mx.concatenate([seen, xf], axis=1)
        w = self.weight.astype(mx.float32)
        out = xf
        for j in range(kernel):
            out = out + window[:, j:j + length, :] * w[j]
        return out.astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.heads = args.swa_num_attention_heads if sliding else args.num_attention_heads
        self.kv_heads = args.swa_num_key_value_heads if sliding else args.num_key_value_heads
        self.head_dim = args.swa_head_dim if sliding else args.head_dim
        self.window = args.sliding_window_size if sliding else None
        self.log_floor = None if sliding else args.log_scaling_n_floor
        self.log_alpha = args.log_scaling_alpha
        extent = args.sliding_window_size if sliding else args.rel_extent
        h, d = args.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.r_proj = nn.Linear(h, self.heads * args.d_rel, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.k_sconv = ShortConv(self.kv_heads * d, args.conv_kernel_size)
        self.v_sconv = ShortConv(self.kv_heads * d, args.conv_kernel_size)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.rel_proj = mx.zeros((args.d_rel, extent))
        #: Set by the target for a row-split verify: each query attends over exactly the keys its own step
        #: would see, so that no product's length (and with it a BLAS's grouping of sums) differs.
        self.stepwise = False

    def __call__(self, x: mx.array, cache: InklingCache | None) -> mx.array:
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, length, self.heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_sconv(self.k_proj(x), cache, "k").reshape(b, length, self.kv_heads, -1)
        v = self.v_sconv(self.v_proj(x), cache, "v").reshape(b, length, self.kv_heads, -1)
        k, v = self.k_norm(k).transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        start = cache.offset if cache is not None else 0
        if cache is not None:
            k, v = cache.kv.update_and_fetch(k, v)
        first = 0  # the position of the first key attended to
        if self.window is not None and k.shape[2] > self.window + length - 1:
            # A sliding layer's queries see only the last window keys each: O(window), not O(context).
            first = k.shape[2] - (self.window + length - 1)
            k, v = k[..., first:, :], v[..., first:, :]
        r = self.r_proj(x).reshape(b, length, self.heads, -1)
        # The bias and the scores are (b, heads, queries, keys): in blocks of queries, so that at a long
        # context a chunk's tensors stay within SCORE_BUDGET elements, however many heads and keys.
        rows = max(1, SCORE_BUDGET // (b * self.heads * k.shape[2]))
        if self.stepwise and length > 1:
            out = mx.concatenate([self._as_step(q, r, k, v, i, start, first) for i in range(length)], axis=2)
        elif length <= rows:
            out = self._attend(q, r, k, v, start, first)
        else:  # each block evaluated before the next: one graph would hold every block's tensors at once
            blocks = []
            for i in range(0, length, rows):
                blocks.append(self._attend(q[:, :, i:i + rows], r[:, i:i + rows], k, v, start + i, first))
                mx.eval(blocks[-1])
            out = mx.concatenate(blocks, axis=2)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def _as_step(self, q: mx.array, r: mx.array, k: mx.array, v: mx.array, i: int, start: int,
                 first: int) -> mx.array:
        """Query *i* of a block at positions ``start...`` (keys from *first*) over the keys its step sees."""
        at = start + i
        lo = max(first, at + 1 - self.window) if self.window is not None else first
        keys = slice(lo - first, at + 1 - first)
        return self._attend(q[:, :, i:i + 1], r[:, i:i + 1], k[..., keys, :], v[..., keys, :], at, lo)

    def _attend(self, q: mx.array, r: mx.array, k: mx.array, v: mx.array, start: int, first: int) -> mx.array:
        """Attention of the queries at positions ``start...`` (their ``r_proj`` states *r*) to the keys at
        positions ``first...``, with the relative bias and the causal (and window) mask."""
        b, _, length, _ = q.shape
        keys = k.shape[2]
        # Bias (b, heads, L, S): query i's profile read at distance (start + i) - j, zero past the extent.
        profiles = (r @ self.rel_proj).transpose(0, 2, 1, 3)
        distance = (mx.arange(start, start + length)[:, None] - mx.arange(first, first + keys)[None, :])
        extent = self.rel_proj.shape[1]
        index = mx.broadcast_to(mx.clip(distance, 0, extent - 1), (b, self.heads, length, keys))
        bias = mx.take_along_axis(profiles, index, axis=-1)
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        bias = mx.where(distance < extent, bias, mx.zeros_like(bias))
        if self.log_floor is not None:
            n = mx.arange(start + 1, start + length + 1).astype(mx.float32)
            tau = (1.0 + self.log_alpha * mx.log(mx.maximum(n / self.log_floor, 1.0)))[:, None]
            q = (q.astype(mx.float32) * tau).astype(q.dtype)
            bias = (bias.astype(mx.float32) * tau).astype(bias.dtype)
        mask = mx.where(allowed, bias, mx.array(-mx.inf, bias.dtype)).astype(q.dtype)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / self.head_dim, mask=mask)


class DenseMLP(nn.Module):
    """SwiGLU; a layer's dense MLP has a learned ``global_scale``, a shared expert does not."""

    def __init__(self, hidden: int, intermediate: int, scaled: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        if scaled:
            self.global_scale = mx.ones((1,))

    def __call__(self, x: mx.array) -> mx.array:
        out = self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))
        return out * self.global_scale if "global_scale" in self else out


class MoE(nn.Module):
    """Sigmoid router over routed + shared experts; the shared ones always take part in the softmax."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.shared, self.route_scale = args.num_experts_per_tok, args.n_shared_experts, args.route_scale
        self.n_routed = args.n_routed_experts
        h, i = args.hidden_size, args.moe_intermediate_size
        self.gate = {"weight": mx.zeros((args.n_routed_experts + self.shared, h)), "global_scale": mx.ones((1,)),
                     "bias": mx.zeros((args.n_routed_experts,))}
        self.switch_mlp = SwitchGLU(h, i, args.n_routed_experts)
        self.shared_experts = [DenseMLP(h, i, scaled=False) for _ in range(self.shared)]
        self.stepwise = False  # as Attention's

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate["weight"].astype(mx.float32).T
        if self.stepwise and x.shape[-2] > 1:  # the router's product a row at a time, as each step's
            logits = mx.concatenate([x[..., i:i + 1, :].astype(mx.float32) @ gate for i in range(x.shape[-2])],
                                    axis=-2)
        else:
            logits = x.astype(mx.float32) @ gate
        routed, shared = logits[..., :self.n_routed], logits[..., self.n_routed:]  # (no shared: empty)
        choice = mx.sigmoid(routed) + self.gate["bias"].astype(mx.float32)
        chosen = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        picked = mx.concatenate([mx.take_along_axis(routed, chosen, axis=-1), shared], axis=-1)
        log_p = nn.log_sigmoid(picked)
        weights = mx.exp(log_p - mx.logsumexp(log_p, axis=-1, keepdims=True))
        weights = (weights * self.route_scale * self.gate["global_scale"].astype(mx.float32)).astype(x.dtype)
        out = (self.switch_mlp(x, chosen) * weights[..., :self.top_k, None]).sum(axis=-2)
        for n, expert in enumerate(self.shared_experts):
            out = out + expert(x) * weights[..., self.top_k + n:self.top_k + n + 1]
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool, dense: bool) -> None:
        super().__init__()
        self.self_attn = Attention(args, sliding)
        self.mlp = DenseMLP(args.hidden_size, args.intermediate_size) if dense else MoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attn_sconv = ShortConv(args.hidden_size, args.conv_kernel_size)
        self.mlp_sconv = ShortConv(args.hidden_size, args.conv_kernel_size)

    def __call__(self, x: mx.array, cache: InklingCache | None) -> mx.array:
        h = x + self.attn_sconv(self.self_attn(self.input_layernorm(x), cache), cache, "attn")
        return h + self.mlp_sconv(self.mlp(self.post_attention_layernorm(h)), cache, "mlp")


class InklingModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.layer_types is not None and args.mlp_layer_types is not None
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.embed_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, kind == "hybrid_sliding", mlp == "dense")
                       for kind, mlp in zip(args.layer_types, args.mlp_layer_types, strict=True)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """The residual stream after the last layer, before the final norm (what the MTP head reads)."""
        h = self.embed_norm(self.embed_tokens(inputs))
        for layer, c in zip(self.layers, cache or [None] * len(self.layers), strict=True):
            h = layer(h, c)
        return h


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = InklingModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        return self.logits(self.model(inputs, cache))

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits from pre-final-norm *hidden*: norm, the mu-P divide, the head, the unpadded vocabulary."""
        out = self.lm_head(self.model.norm(hidden) / self.args.logits_mup_width_multiplier)
        keep = self.args.unpadded_vocab_size
        return out[..., :keep] if keep is not None and keep < out.shape[-1] else out

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[InklingCache]:
        return [InklingCache() for _ in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The raw checkpoint names (``model.llm.*``, as transformers' ``save_pretrained`` writes them and
        the published repository holds them) to this module's; the vision and audio towers dropped."""
        out: dict[str, mx.array] = {}
        for key, value in weights.items():
            if key.startswith("model.llm."):
                out.update(remap_layer_weights(key.removeprefix("model.llm."), value, "model."))
            elif not key.startswith(("model.visual.", "model.audio.", "model.mtp.")):
                out[key] = value  # already in this module's names (a converted copy)
        return out
