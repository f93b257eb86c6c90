"""The parts of mlx-lm that mlxcel relies on beyond its documented API, on this install.

mlxcel reaches into mlx-lm: private gated-delta functions, the attributes of
Qwen 3.5's GatedDeltaNet, the arrays of an ArraysCache, the BatchGenerator's
insert/remove protocol, the LRU prompt cache, ``_get_classes``. pyproject.toml
pins mlx-lm to the range these were checked against. When a release changes
one of them, a test here fails and its message names what changed; without
them the change would surface as an exception on the MLX thread, or as an
exactness probe that quietly vetoes every pairing.

Uses found with ``grep -rn mlx_lm mlxcel tests benchmarks``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from mlxcel.testing.checkpoints import CONFIGS

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def require_call(func: Callable[..., Any], name: str, positional: tuple[str, ...],
                 keywords: tuple[str, ...] = ()) -> None:
    """Fail, naming *name*, unless mlxcel's call ``func(*positional, **keywords)`` still binds as meant.

    The first parameters must be *positional*, in that order (mlxcel passes them
    by position); each of *keywords* must be accepted by keyword; and no other
    parameter may be required.
    """
    signature = inspect.signature(func)
    params = [p for p in signature.parameters.values() if p.name != "self"]
    used = f"mlxcel calls {name}({', '.join(positional)}{', ' if keywords else ''}" \
           f"{', '.join(k + '=' for k in keywords)}), but it is now {name}{signature}"
    leading = [p.name for p in params[:len(positional)] if p.kind in POSITIONAL]
    assert leading == list(positional), f"{used}: its leading positional parameters changed"
    by_name = {p.name: p for p in params}
    missing = [k for k in keywords if k not in by_name or by_name[k].kind not in BY_KEYWORD]
    assert not missing, f"{used}: keyword(s) {missing} are gone"
    required = [p.name for p in params[len(positional):] if p.name not in keywords
                and p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    assert not required, f"{used}: new required parameter(s) {required}"


def _build(family: str) -> Any:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(CONFIGS[family])
    mx.random.seed(0)
    model = model_class(args_class.from_dict(CONFIGS[family]))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def qwen35() -> Any:
    return _build("qwen3_5")


@pytest.fixture(scope="module")
def llama() -> Any:
    return _build("llama")


# -- signatures -------------------------------------------------------------------------


@pytest.mark.parametrize(("owner", "name", "positional", "keywords"), [
    # engine/mtp.py: the gated-delta recurrence, token by token.
    ("gated_delta", "_gated_delta_step_ops", ("q", "k", "v", "g", "beta", "state", "mask"), ()),
    ("gated_delta", "compute_g", ("A_log", "a", "dt_bias"), ()),
    ("gated_delta", "normalize_qk", ("q", "k"), ("inv_scale", "eps")),
    ("gated_delta", "gated_delta_update", ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask"),
     ("use_kernel",)),
    # engine/worker.py: continuous batching and the prefix cache.
    ("generate", "BatchGenerator.__init__", ("model",),
     ("stop_tokens", "completion_batch_size", "prefill_batch_size", "prefill_step_size", "stream")),
    ("generate", "BatchGenerator.insert", ("prompts",), ("max_tokens", "caches", "all_tokens", "samplers")),
    ("generate", "BatchGenerator.remove", ("uids",), ("return_prompt_caches",)),
    ("generate", "BatchGenerator.next", (), ()),
    ("generate", "BatchGenerator.close", (), ()),
    ("cache", "LRUPromptCache.__init__", (), ("max_size",)),
    ("cache", "LRUPromptCache.fetch_nearest_cache", ("model", "tokens"), ()),
    ("cache", "LRUPromptCache.insert_cache", ("model", "tokens", "prompt_cache"), ()),
    ("cache", "can_trim_prompt_cache", ("cache",), ()),
    ("cache", "trim_prompt_cache", ("cache", "num_tokens"), ()),
    ("cache", "make_prompt_cache", ("model",), ()),
    # Samplers (worker, solo decoder, speculative sampler).
    ("sample_utils", "apply_top_k", ("logprobs", "top_k"), ()),
    ("sample_utils", "apply_top_p", ("logprobs", "top_p"), ()),
    ("sample_utils", "make_sampler", (), ("temp", "top_p", "top_k")),
    ("sample_utils", "greedy_sampler", ("logprobs",), ()),
    # models/: loading, the bundled model's trainer, the tests' checkpoints, the MTP head.
    ("utils", "_get_classes", ("config",), ()),
    ("utils", "load", ("path_or_hf_repo",), ()),
    ("base", "create_attention_mask", ("h", "cache"), ()),
    ("qwen3_5", "DecoderLayer.__init__", ("args",), ("layer_idx",)),
])
def test_the_signatures_mlxcel_calls(owner: str, name: str, positional: tuple[str, ...],
                                     keywords: tuple[str, ...]) -> None:
    module = importlib.import_module(
        {"generate": "mlx_lm.generate", "sample_utils": "mlx_lm.sample_utils", "utils": "mlx_lm.utils"}.get(
            owner, f"mlx_lm.models.{owner}"))
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
        assert target is not None, f"mlx_lm {module.__name__}.{name} is gone (mlxcel uses it)"
    require_call(target, f"{module.__name__}.{name}", positional, keywords)


def test_module_constants_mlxcel_reads() -> None:
    from mlx_lm.utils import MODEL_REMAPPING

    # models/loader.py maps a config's model_type to an mlx_lm.models module through it.
    assert isinstance(MODEL_REMAPPING, dict), "mlx_lm.utils.MODEL_REMAPPING is no longer a dict"
    from mlx_lm.models.qwen3_5 import TextModelArgs

    args = TextModelArgs.from_dict(CONFIGS["qwen3_5"]["text_config"])
    for field in ("hidden_size", "rms_norm_eps", "full_attention_interval"):  # read by the MTP head
        assert hasattr(args, field), f"mlx_lm qwen3_5.TextModelArgs has no {field} any more"


# -- Qwen 3.5 on a real instance ------------------------------------------------------

MIXER_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv_kernel_size", "conv_dim",
                    "key_dim", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "A_log", "dt_bias",
                    "conv1d", "norm", "out_proj", "sharding_group", "training")


def _linear_layers(model: Any) -> list[tuple[int, Any]]:
    return [(i, layer) for i, layer in enumerate(model.language_model.model.layers)
            if getattr(layer, "is_linear", False)]


def test_the_model_layout_the_mtp_target_reads(qwen35: Any) -> None:
    """engine/mtp.py's TargetModel: language_model.model (body, embed_tokens, layers with
    is_linear/linear_attn) and language_model.lm_head, whose composition is the model."""
    inner = getattr(qwen35, "language_model", None)
    assert inner is not None, "mlx_lm qwen3_5.Model has no language_model"
    for path, owner in (("model", inner), ("lm_head", inner), ("embed_tokens", inner.model),
                        ("layers", inner.model)):
        assert hasattr(owner, path), f"mlx_lm qwen3_5: {path} is gone from {type(owner).__name__}"
    assert _linear_layers(qwen35), "no qwen3_5 layer says is_linear: the gated-delta layers are not found"
    for _, layer in _linear_layers(qwen35):
        assert hasattr(layer, "linear_attn"), "mlx_lm qwen3_5 DecoderLayer.linear_attn is gone"
    tokens = mx.array([[3, 1, 4, 1, 5]])
    composed = inner.lm_head(inner.model(tokens, make_prompt_cache(qwen35)))
    assert mx.array_equal(composed, qwen35(tokens, cache=make_prompt_cache(qwen35))), (
        "qwen3_5: lm_head(model(tokens, cache)) is no longer what Model.__call__ returns")


def test_gated_delta_net_attributes_and_call(qwen35: Any) -> None:
    """The attributes _gated_delta_block reads, the shapes it derives from them, and how the
    decoder layer calls its mixer (positionally, with no mask for one unpadded sequence)."""
    index, layer = _linear_layers(qwen35)[0]
    mixer = layer.linear_attn
    missing = [a for a in MIXER_ATTRIBUTES if not hasattr(mixer, a)]
    assert not missing, f"mlx_lm {type(mixer).__name__} lost attribute(s) {missing}"
    assert mixer.sharding_group is None
    assert isinstance(mixer.conv_kernel_size, int) and mixer.conv_kernel_size > 1
    assert mixer.key_dim == mixer.num_k_heads * mixer.head_k_dim, "GatedDeltaNet.key_dim is not heads x dim"
    assert mixer.conv_dim == 2 * mixer.key_dim + mixer.num_v_heads * mixer.head_v_dim, (
        "GatedDeltaNet.conv_dim is no longer q + k + v: mlxcel splits the conv output by key_dim")
    x = mx.zeros((1, 3, qwen35.language_model.model.embed_tokens.weight.shape[1]))
    assert mixer.in_proj_qkv(x).shape[-1] == mixer.conv_dim

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Recorder:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            return mixer(*args, **kwargs)

    cache = make_prompt_cache(qwen35)
    layer.linear_attn = Recorder()
    try:
        qwen35.language_model.model(mx.array([[3, 1, 4]]), cache)
    finally:
        layer.linear_attn = mixer
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert not kwargs and len(args) == 3, f"the decoder layer now calls its mixer as (*{len(args)}, **{kwargs})"
    assert args[1] is None, "one unpadded sequence now gets a mask: mlxcel's verify would not keep its states"
    assert args[2] is cache[index]


def test_arrays_cache_arrays_can_be_replaced(qwen35: Any) -> None:
    """A rollback assigns ArraysCache.cache = [conv, recurrent]; reads go through [0] and [1]."""
    cache = make_prompt_cache(qwen35)
    for index, _ in _linear_layers(qwen35):
        assert isinstance(cache[index], ArraysCache), "qwen3_5's gated-delta layers no longer use ArraysCache"
    attention = [c for i, c in enumerate(cache) if i not in dict(_linear_layers(qwen35))]
    assert attention and all(c.is_trimmable() and hasattr(c, "trim") for c in attention)
    arrays = ArraysCache(2)
    assert isinstance(arrays.cache, list) and len(arrays.cache) == 2, "ArraysCache.cache is no longer a list"
    conv, recurrent = mx.ones((1, 3, 4)), mx.zeros((1, 2, 4, 4))
    arrays.cache = [conv, recurrent]
    assert arrays[0] is conv and arrays[1] is recurrent, "ArraysCache[i] no longer reads ArraysCache.cache"
    assert hasattr(arrays, "advance") and hasattr(arrays, "merge"), "ArraysCache lost advance or merge"


# -- BatchGenerator and the prefix cache ------------------------------------------------


def _greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out: list[int] = []
    for _ in range(count):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([out[-1:]]), cache=cache)
    return out


def _generator(model: Any) -> Any:
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, stop_tokens=[[0]], completion_batch_size=2, prefill_batch_size=2,
                          prefill_step_size=64, stream=mx.default_stream(mx.default_device()))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_parked_sequence_continues_in_the_batch(family: str, llama: Any, qwen35: Any) -> None:
    """The solo-to-batch handoff: insert([[unfed token]], caches=[cache], all_tokens=[fed tokens])
    continues exactly where the cache stands; remove(..., return_prompt_caches=True) gives back
    a cache holding exactly the tokens it reports, as the prefix cache stores it."""
    model = {"llama": llama, "qwen3_5": qwen35}[family]
    prompt = [5, 17, 99, 123, 7, 8]
    expected = _greedy(model, prompt, 3)
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    generator = _generator(model)
    try:
        (uid,) = generator.insert([prompt[-1:]], max_tokens=[10], caches=[cache], all_tokens=[prompt[:-1]],
                                  samplers=[None])
        tokens: list[int] = []
        while len(tokens) < 3:
            step = generator.next()
            assert isinstance(step, tuple) and len(step) == 2, "BatchGenerator.next() no longer returns a pair"
            for response in step[1]:
                assert response.uid == uid and response.finish_reason is None
                tokens.append(response.token)
        assert tokens == expected, "a sequence handed to the BatchGenerator with its cache did not continue"
        removed = generator.remove([uid], return_prompt_caches=True)
        assert set(removed) == {uid}, "remove(return_prompt_caches=True) no longer maps uid -> (cache, tokens)"
        kept, all_tokens = removed[uid]
        assert list(all_tokens[:len(prompt) + 3]) == prompt + tokens
        assert {c.offset for c in kept if isinstance(c, KVCache)} == {len(all_tokens)}
    finally:
        generator.close()


def test_a_finished_response_carries_its_cache_and_tokens(llama: Any) -> None:
    generator = _generator(llama)
    try:
        generator.insert([[5, 17, 99]], max_tokens=[4], samplers=[None])
        finished = None
        while finished is None:
            finished = next((r for r in generator.next()[1] if r.finish_reason is not None), None)
        assert finished.finish_reason == "length"
        assert finished.logprobs.shape[-1] == CONFIGS["llama"]["vocab_size"]
        assert len(finished.all_tokens) == 3 + 4
        assert {c.offset for c in finished.prompt_cache} == {len(finished.all_tokens)}
    finally:
        generator.close()


def test_the_lru_prompt_cache_reuses_the_nearest_prefix(llama: Any) -> None:
    lru = LRUPromptCache(max_size=2)
    cache = make_prompt_cache(llama)
    llama(mx.array([[5, 17, 99, 123]]), cache=cache)
    lru.insert_cache("model", [5, 17, 99, 123], cache)
    assert len(lru) == 1 and lru.nbytes > 0, "LRUPromptCache lost len() or nbytes"
    found, rest = lru.fetch_nearest_cache("model", [5, 17, 99, 123, 7, 8])
    assert found is not None and list(rest) == [7, 8], "fetch_nearest_cache no longer returns (cache, rest)"
    assert can_trim_prompt_cache(found)
    trim_prompt_cache(found, 1)
    assert {c.offset for c in found} == {3}
    assert lru.fetch_nearest_cache("other", [5, 17]) == (None, [5, 17])


def test_the_samplers_mlxcel_builds() -> None:
    from mlx_lm.sample_utils import apply_top_k, greedy_sampler, make_sampler

    logprobs = mx.array([[-3.0, -0.1, -2.0, -4.0]])
    assert make_sampler(temp=0.0) is greedy_sampler
    assert int(greedy_sampler(logprobs).item()) == 1
    assert mx.isinf(apply_top_k(logprobs, 2)).tolist() == [[True, False, False, True]]  # the 2 likeliest kept
    with pytest.raises(ValueError):  # top_k must stay below the vocab: mlxcel has to keep it there
        apply_top_k(logprobs, 4)


def test_the_mtp_head_builds_from_mlx_lm_parts() -> None:
    """models/drafters/qwen3_5_mtp.py: a full-attention DecoderLayer, create_attention_mask, KVCache."""
    from mlxcel.families.qwen3_5.mtp import Qwen35MTP, text_args

    args = text_args(CONFIGS["qwen3_5"])
    head = Qwen35MTP(args, num_layers=1)
    assert not getattr(head.layers[0], "is_linear", True), "DecoderLayer(layer_idx=interval-1) is not attention"
    cache = head.make_cache()
    out = head(mx.zeros((1, 2, args.hidden_size)), mx.zeros((1, 2, args.hidden_size)), cache)
    assert out.shape == (1, 2, args.hidden_size) and cache[0].offset == 2


def test_the_generation_batch_seams_batch_speculation_reads(qwen35: Any) -> None:
    """What mlxcel/engine/batch_speculation.py reads and writes of mlx-lm's GenerationBatch: the model called
    from ``_step`` with one token per row (told apart by its frame), ``uids``, ``tokens``, ``_next_tokens``
    (pending, not fed), ``_next_logprobs``, ``_num_tokens``, ``max_tokens``, ``_matchers``, ``Response``,
    ``filter``, ``extract_cache``, and ``next`` looked up on the instance by ``BatchGenerator._next``; for a row
    riding along at K=0, the classic step's per-row ``logits_processors``, ``_token_context``, ``samplers`` and
    ``fallback_sampler``."""
    import sys

    from mlx_lm.generate import GenerationBatch

    calls: list[tuple[bool, list[int], tuple[int, ...]]] = []

    class Tap:
        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            caller = sys._getframe(1)
            from_step = caller.f_code is GenerationBatch._step.__code__
            calls.append((from_step, list(caller.f_locals["self"].uids) if from_step else [], tuple(inputs.shape)))
            return qwen35(inputs, cache=cache)

        def __getattr__(self, name: str) -> Any:
            return getattr(qwen35, name)

    generator = _generator(Tap())
    try:
        uids = generator.insert([[5, 17, 99], [7, 8]], max_tokens=[6, 6], samplers=[None, None])
        while not generator._generation_batch.uids:
            generator.next()
        batch = generator._generation_batch
        assert isinstance(batch, GenerationBatch) and sorted(batch.uids) == sorted(uids)
        assert any(from_step and rows == batch.uids and shape == (2, 1) for from_step, rows, shape in calls), \
            "GenerationBatch._step no longer calls the model with one token per row"
        assert sorted(len(t) for t in batch.tokens) == [2, 3] and batch._next_tokens.shape == (2,)
        assert len(batch._next_logprobs) == 2 and batch._num_tokens == [0, 0] and batch.max_tokens == [6, 6]
        assert len(batch._matchers) == 2 and callable(batch._matchers[0].advance)
        assert len(batch.logits_processors) == 2 and len(batch._token_context) == 2
        assert callable(batch._token_context[0].update_and_fetch) and callable(batch.fallback_sampler)
        assert batch.samplers is None or len(batch.samplers) == 2
        assert {"uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens"} <= \
            set(GenerationBatch.Response.__dataclass_fields__)
        batch.next = list  # type: ignore[method-assign]
        try:
            _, responses = generator.next()
        finally:
            del batch.next
        assert responses == [], "BatchGenerator._next no longer calls the generation batch's next()"
        assert callable(batch.filter) and callable(batch.extract_cache)
    finally:
        generator.close()


def test_the_prompt_batch_seam_the_tap_reads(qwen35: Any) -> None:
    """What HiddenTap (mlxcel/engine/batch_speculation.py) reads of mlx-lm's ``PromptProcessingBatch.prompt``
    when it calls the model with a chunk of the rows' prompts: its ``self.uids``, and its locals ``lengths``
    (each row's tokens in this call), ``max_length`` and ``tokens`` (what is left of the right-padded prompts,
    the chunk at its front), so a chunk's place in each row's prompt is ``max_length - tokens.shape[1]``."""
    import sys

    from mlx_lm.generate import PromptProcessingBatch

    seen: list[tuple[list[int], list[int], int, tuple[int, ...]]] = []

    class Tap:
        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            caller = sys._getframe(1)
            if caller.f_code is PromptProcessingBatch.prompt.__code__:
                local = caller.f_locals
                seen.append((list(local["self"].uids), list(local["lengths"]),
                             local["max_length"] - local["tokens"].shape[1], tuple(inputs.shape)))
            return qwen35(inputs, cache=cache)

        def __getattr__(self, name: str) -> Any:
            return getattr(qwen35, name)

    generator = _generator(Tap())
    try:
        uids = generator.insert([list(range(3, 100)), list(range(5, 40))], max_tokens=[4, 4], samplers=[None, None])
        while len(generator._generation_batch.uids) < 2:
            generator.next()
    finally:
        generator.close()
    # Each call a chunk of at most prefill_step_size (64) a row, right-padded; a prompt's last token is left
    # for the generation batch's first step.
    assert seen == [(uids, [64, 34], 0, (2, 64)), (uids[:1], [32], 0, (1, 32))], seen
