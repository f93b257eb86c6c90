"""Gemma 4's images against transformers: how many soft tokens an image becomes, and the text model's logits for a
prompt holding one (its features from mlx-vlm's vision tower, its embeddings and masks from
:mod:`mlxcel.families.gemma4.vision`), prefilled into the family's own caches, then a decode step after it.

The reference is transformers' ``Gemma4ForConditionalGeneration`` on the same token ids, with its own image
processor's pixels and ``mm_token_type_ids`` (which turn on the bidirectional image mask where the config asks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint
from mlxcel.families.gemma4.image_size import ImageGeometry, soft_tokens
from mlxcel.families.gemma4.target import text_model
from mlxcel.families.gemma4.tiny_vision import build_vision_checkpoint
from mlxcel.families.gemma4.vision import Gemma4Vision, image_masks, masked, prompt_embeddings

SIZES = [(1024, 768), (640, 480), (1920, 1080), (100, 100), (37, 500), (500, 37), (3000, 20), (20, 3000), (1, 1)]


@pytest.mark.parametrize("geometry", [ImageGeometry(16, 3, 280), ImageGeometry(4, 3, 70), ImageGeometry(16, 3, 1120)])
def test_an_image_becomes_as_many_soft_tokens_as_transformers_makes(geometry: ImageGeometry) -> None:
    from transformers import Gemma4ImageProcessorPil

    processor = Gemma4ImageProcessorPil(patch_size=geometry.patch, pooling_kernel_size=geometry.pooling,
                                        max_soft_tokens=geometry.max_soft_tokens)
    for width, height in SIZES:
        image = Image.new("RGB", (width, height), (10, 20, 30))
        expected = int(processor(images=[image], return_tensors="np", input_data_format="channels_last")
                       ["num_soft_tokens_per_image"][0])
        assert soft_tokens(width, height, geometry) == expected, (width, height)


@pytest.fixture(scope="module", params=[True, False], ids=["bidirectional", "causal"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("gemma4-vision") / "tiny", bidirectional=request.param)


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(120, 160, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(tokenizer: Any, count: int) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], add_generation_prompt=True, tokenize=False)
    expanded = text.replace("<|image|>", "<|image>" + "<|image|>" * count + "<image|>")
    return list(tokenizer.encode(expanded, add_special_tokens=False))


def _reference(checkpoint: Path, ids: list[int], image: Image.Image, image_token: int) -> np.ndarray:
    from transformers import AutoModelForImageTextToText, Gemma4ImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    pixels = Gemma4ImageProcessorPil.from_pretrained(checkpoint)(images=[image], return_tensors="pt")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=tokens, pixel_values=pixels["pixel_values"],
                     image_position_ids=pixels["image_position_ids"],
                     mm_token_type_ids=(tokens == image_token).long()).logits[0].numpy()


def test_the_logits_of_a_prompt_with_an_image_are_transformers(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    geometry = ImageGeometry(processor["patch_size"], processor["pooling_kernel_size"], processor["max_soft_tokens"])
    model, tokenizer = load_checkpoint(inspect_checkpoint(checkpoint))
    vision = Gemma4Vision(checkpoint, config, geometry)
    inner = text_model(model).model
    image = _image(0)
    count = soft_tokens(image.width, image.height, geometry)
    ids = _prompt(tokenizer, count)
    next_token = 50
    reference = _reference(checkpoint, [*ids, next_token], image, vision.image_token_id)

    plain, embedded = prompt_embeddings(inner, ids, [vision.features(image)], vision.image_token_id)
    cache = model.make_cache()  # the family's caches: a sliding-window ring on the sliding layers
    masks = image_masks([layer.layer_type for layer in inner.layers], inner.window_size, ids,
                        vision.image_token_id) if vision.bidirectional else None
    assert len(ids) > inner.window_size  # the image reaches past the window: the ring and the masks both matter
    with masked(inner, masks):
        prefill = np.array(model(plain, cache=cache, input_embeddings=embedded)[0].astype(mx.float32))
    step = np.array(model(mx.array([[next_token]]), cache=cache)[0, -1].astype(mx.float32))
    assert np.abs(prefill - reference[:-1]).max() < 1e-3 * max(1.0, np.abs(reference).max())
    assert np.abs(step - reference[-1]).max() < 1e-3 * max(1.0, np.abs(reference).max())

    other_plain, other = prompt_embeddings(inner, ids, [vision.features(_image(1))], vision.image_token_id)
    with masked(inner, masks):
        changed = np.array(model(other_plain, input_embeddings=other)[0, -1].astype(mx.float32))
    assert np.abs(changed - prefill[-1]).max() > 1e-2  # another image, another answer
    with pytest.raises(ValueError, match="image tokens"):
        prompt_embeddings(inner, [*ids[:-5], vision.image_token_id], [vision.features(image)], vision.image_token_id)


def test_an_images_features_are_kept_by_its_hash(tmp_path: Path) -> None:
    from mlxcel.models.images import PromptImage

    checkpoint = build_vision_checkpoint(tmp_path / "tiny")
    config = json.loads((checkpoint / "config.json").read_text())
    vision = Gemma4Vision(checkpoint, config, ImageGeometry(4, 3, 70))
    first = vision.cached_features(PromptImage("a", _image(0)))
    assert np.array_equal(np.array(first), np.array(vision.features(_image(0))))
    again = vision.cached_features(PromptImage("a", _image(9)))  # the same hash: kept, not computed again
    assert again is first and list(vision.kept) == ["a"]
    vision.cached_features(PromptImage("b", _image(1)))
    assert list(vision.kept) == ["a", "b"]


def test_the_prefill_goes_on_from_the_text_before_the_image_in_steps(checkpoint: Path) -> None:
    """As the worker runs it: the text before the image already in the cache (a text prefill's, or the prefix
    cache's snapshot of an agent's long system prompt), the rest in steps of 8 (in one forward where the image's
    bidirectional masks apply, built for the positions the cache holds): transformers' next logits."""
    from mlxcel.models.images import PromptImage

    config = json.loads((checkpoint / "config.json").read_text())
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    geometry = ImageGeometry(processor["patch_size"], processor["pooling_kernel_size"], processor["max_soft_tokens"])
    model, tokenizer = load_checkpoint(inspect_checkpoint(checkpoint))
    vision = Gemma4Vision(checkpoint, config, geometry)
    image = _image(2)
    ids = _prompt(tokenizer, soft_tokens(image.width, image.height, geometry))
    ids = ids[:3] + list(tokenizer.encode(" a long system prompt" * 6, add_special_tokens=False)) + ids[3:]
    reference = _reference(checkpoint, [*ids, 50], image, vision.image_token_id)
    first = ids.index(vision.image_token_id)
    cache = model.make_cache()
    model(mx.array([ids[:first]]), cache=cache)
    assert first > text_model(model).model.window_size  # the ring has wrapped before the image
    vision.prefill(model, ids, (PromptImage("a", image),), cache, start=first, step=8)
    step = np.array(model(mx.array([[50]]), cache=cache)[0, -1].astype(mx.float32))
    assert np.abs(step - reference[-1]).max() < 1e-3 * max(1.0, np.abs(reference).max())
