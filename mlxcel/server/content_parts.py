"""A chat message's content parts: text, and images (the other APIs' images are converted to these)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(BaseModel):
    """An image (:mod:`.images` reads it); the other APIs' images arrive as these too, with ``where``: the place of
    the image in their own request (``input.2.content``), which errors name."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]
