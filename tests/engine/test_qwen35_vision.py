"""Qwen 3.5's images against transformers: an image's size and patches, the prompt's multi-axis positions, and the
text model's logits and greedy text for a prompt holding two images (features from mlx-vlm's vision tower,
positions from :mod:`mlxcel.families.qwen3_5.vision`), dense and MoE.

The reference is transformers' ``Qwen3_5ForConditionalGeneration`` (``Qwen3_5MoeForConditionalGeneration``) on the
same token ids, with its own image processor's pixels and ``get_rope_index``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint, load_vision
from mlxcel.families.qwen3_5.image_size import ImageGeometry, grid, image_tokens
from mlxcel.families.qwen3_5.tiny_vision import build_vision_checkpoint
from mlxcel.families.qwen3_5.vision import positioned, rope_positions
from mlxcel.models.images import PromptImage

SIZES = [(1024, 768), (640, 480), (1920, 1080), (100, 100), (37, 500), (500, 37), (3000, 20), (20, 3000), (1, 1)]
TOKENS = 12


@pytest.mark.parametrize("geometry", [ImageGeometry(), ImageGeometry(16, 2, 2, 32 * 32, 64 * 64 * 4),
                                      ImageGeometry(14, 2, 2, 56 * 56, 28 * 28 * 1280)])
def test_an_image_becomes_as_many_tokens_as_transformers_makes(geometry: ImageGeometry) -> None:
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=geometry.patch, merge_size=geometry.merge,
                                         temporal_patch_size=geometry.temporal_patch,
                                         size={"shortest_edge": geometry.min_pixels,
                                               "longest_edge": geometry.max_pixels})
    for width, height in SIZES:
        _, rows, columns = processor(images=[Image.new("RGB", (width, height))], return_tensors="np")[
            "image_grid_thw"][0]
        assert grid(width, height, geometry) == (rows, columns), (width, height)
        assert image_tokens(width, height, geometry) == rows * columns // geometry.merge ** 2


def _image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("qwen35-vision") / "tiny", moe=request.param)


def _prompt(tokenizer: Any, counts: list[int]) -> list[int]:
    """A user turn: an image, a question, another image, a word; each image's marker expanded to *counts*."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image"}, {"type": "text", "text": "and"}
    ]}], add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    spans = ["<|image_pad|>" * count for count in counts]
    expanded = pieces[0] + "".join(span + piece for span, piece in zip(spans, pieces[1:], strict=True))
    return list(tokenizer.encode(expanded, add_special_tokens=False))


def test_a_prompt_with_images_gives_transformers_logits_and_text(checkpoint: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    info = inspect_checkpoint(checkpoint)
    model, tokenizer = load_checkpoint(info)
    vision = load_vision(info, model)
    pictures = [_image(0, 200, 150), _image(1, 64, 130)]
    images = tuple(PromptImage(f"{seed:012x}", picture) for seed, picture in enumerate(pictures))
    pixels = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=pictures, return_tensors="pt")
    ours = mx.concatenate([vision.patches(picture)[0] for picture in pictures])
    assert np.array_equal(np.array(ours), pixels["pixel_values"].numpy())  # resized and cut as transformers does
    assert vision.grids(images) == [tuple(int(n) // m for n, m in zip(g, (1, 2, 2), strict=True))
                                    for g in pixels["image_grid_thw"]]
    ids = _prompt(tokenizer, [int(g.prod()) // 4 for g in pixels["image_grid_thw"]])

    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    tokens = torch.tensor([ids])
    kinds = (tokens == vision.image_token_id).int()
    positions, _ = reference.model.get_rope_index(tokens, kinds, image_grid_thw=pixels["image_grid_thw"])
    ours, following = rope_positions(ids, vision.image_token_id, vision.grids(images))
    assert np.array_equal(ours, positions[:, 0].numpy()) and following == ours[0, -1] + 1
    with torch.no_grad():
        inputs = {"input_ids": tokens, "pixel_values": pixels["pixel_values"], "mm_token_type_ids": kinds,
                  "image_grid_thw": pixels["image_grid_thw"]}
        logits = reference(**inputs).logits[0, -1].numpy()
        greedy = reference.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)[0, len(ids):].tolist()

    cache = make_prompt_cache(model)
    vision.prefill(model, ids[:-1], images, cache)
    step = np.array(model(mx.array([ids[-1:]]), cache=cache)[0, -1])
    assert np.abs(step - logits).max() < 1e-4 * max(1.0, np.abs(logits).max())
    said = [int(np.argmax(step))]
    while len(said) < TOKENS:  # decode after the images at the cache's own offset: the shift made that right
        said.append(int(mx.argmax(model(mx.array([said[-1:]]), cache=cache)[0, -1])))
    assert said == greedy

    # In chunks of 7 tokens (the images' spans cut anywhere): the same.
    chunked = make_prompt_cache(model)
    vision.prefill(model, ids[:-1], images, chunked, step=7)
    again = np.array(model(mx.array([ids[-1:]]), cache=chunked)[0, -1])
    assert np.abs(again - logits).max() < 1e-4 * max(1.0, np.abs(logits).max())
    # From a cache that holds the prompt's text before its first image, at the prompt's (shifted) positions.
    first = ids.index(vision.image_token_id)
    shift = len(ids) - 1 - rope_positions(ids[:-1], vision.image_token_id, vision.grids(images))[1]
    resumed = make_prompt_cache(model)
    with positioned(model.language_model.model, mx.array(np.tile(np.arange(first) + shift, (3, 1))), vision.sections):
        model(mx.array([ids[:first]]), cache=resumed)
    vision.prefill(model, ids[:-1], images, resumed, start=first, step=16)
    again = np.array(model(mx.array([ids[-1:]]), cache=resumed)[0, -1])
    assert np.abs(again - logits).max() < 1e-4 * max(1.0, np.abs(logits).max())

    # The positions matter: the same embeddings at plain positions answer otherwise.
    plain = make_prompt_cache(model)
    body = model.language_model.model
    embedded = body.embed_tokens(mx.array([ids[:-1]]))
    where = mx.array(np.nonzero(np.asarray(ids[:-1]) == vision.image_token_id)[0])
    embedded[0, where] = mx.concatenate([vision.cached_features(image) for image in images])
    model(mx.array([ids[:-1]]), cache=plain, input_embeddings=embedded)
    assert np.abs(np.array(model(mx.array([ids[-1:]]), cache=plain)[0, -1]) - logits).max() > 1e-3
    with positioned(body, mx.array(np.zeros((3, 4), dtype=np.int64)), vision.sections):
        pass  # the block leaves the model's own rotary embeddings in place
    assert all(type(layer.self_attn.rope).__name__ == "RoPE" for layer in body.layers if not layer.is_linear)


def test_the_prefix_cache_keys_the_images_and_their_positions(checkpoint: Path) -> None:
    """Two prompts share keys only where they share images, and where their tokens sit at the same positions: a
    second image shifts the first's too, so a prompt with one image more shares none of its keys."""
    info = inspect_checkpoint(checkpoint)
    model, tokenizer = load_checkpoint(info)
    vision = load_vision(info, model)
    first, second, third = (PromptImage(f"{seed:012x}", _image(seed, 200, 150)) for seed in range(3))
    ids = _prompt(tokenizer, [30, 30])
    keys = vision.keys(ids, (first, second))
    assert len(keys) == len(ids) and keys == vision.keys(ids, (first, second))
    changed = vision.keys(ids, (first, third))
    split = ids.index(vision.image_token_id, ids.index(vision.image_token_id) + 30)  # the second image's first token
    assert changed[:split] == keys[:split] and changed[split] != keys[split]
    assert vision.keys([*ids[:split], *ids[-3:]], (first,))[0] != keys[0]  # one image fewer: another shift
    text = list(tokenizer.encode("plain text", add_special_tokens=False))
    assert vision.keys(text, ()) == text


def test_the_chunked_recurrence_is_mlx_lms_token_by_token_one() -> None:
    """:func:`~mlxcel.families.qwen3_5.chunked_delta.chunked_delta` against mlx-lm's per-token step, from a
    state, over 150 tokens (two chunks and a padded third): the same outputs and state to float rounding."""
    from mlx_lm.models.gated_delta import _gated_delta_step_ops

    from mlxcel.families.qwen3_5.chunked_delta import chunked_delta

    rng = np.random.default_rng(0)

    def drawn(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = drawn(2, 150, 3, 8), drawn(2, 150, 3, 8), drawn(2, 150, 3, 6)
    k = k / mx.sqrt((k * k).sum(-1, keepdims=True))
    log_decay, beta, state = -mx.abs(drawn(2, 150, 3)) * 0.3, mx.sigmoid(drawn(2, 150, 3)), drawn(2, 3, 6, 8) * 0.1
    y, after = chunked_delta(q, k, v, log_decay, beta, state)
    steps = []
    for t in range(150):
        out, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], mx.exp(log_decay[:, t]), beta[:, t], state, None)
        steps.append(out)
    assert np.abs(np.array(y) - np.array(mx.stack(steps, axis=1))).max() < 1e-5
    assert np.abs(np.array(after) - np.array(state)).max() < 1e-5
