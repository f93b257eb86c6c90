"""Images in a request: where they come from, and the checks every one passes before a model sees it (no mlx).

Every route hands its images over as chat ``image_url`` parts (Anthropic's ``image`` blocks and the Responses API's
``input_image`` parts are converted to them), so this is the one place an image is read. A source is a ``data:``
URL (base64), or an ``http(s)`` URL where the server is told to fetch them (:mod:`.image_fetch`: a server that
fetches any URL a request names is a hole into the network it sits on). The checks, each a 400 naming the image
and the problem, never its content: bytes, format (PNG, JPEG, WebP, GIF, BMP; SVG and everything else refused),
pixels (read from the header, before anything is decoded: a decompression bomb costs nothing), a whole decode
(truncated or corrupt data), and images per request. Decoding needs Pillow (the ``vision`` extra).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

from ..http.errors import ApiError, bad_request

#: Formats decoded (Pillow's names); a vision model's processor takes any of them as RGB.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
INSTALL = "pip install 'mlxcel[vision]'"


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on a request's images (``--max-images``, ``--max-image-bytes``, ``--max-image-pixels``)."""

    max_images: int = 16
    max_bytes: int = 5 * 1024 * 1024
    """Anthropic's own bound on one image."""
    max_pixels: int = 33_554_432
    """32 megapixels: an 8K screenshot fits; a vision processor resizes far below it anyway."""
    fetch_urls: bool = False
    """``--allow-image-urls``: fetch ``http(s)`` URLs (:mod:`.image_fetch`)."""
    private_urls: bool = False
    """``--allow-private-image-urls``: from loopback and private addresses too."""
    fetch_seconds: float = 10.0
    """``--image-fetch-timeout``: one image's whole fetch, redirects included."""


@dataclass(frozen=True)
class ImageRef:
    """An image as a request gives it: its place (for errors) and its URL."""

    where: str
    url: str
    data: bytes | None = field(default=None, repr=False)
    """An ``http(s)`` URL's bytes, once fetched (:func:`~mlxcel.server.image_fetch.fetch_all`)."""


@dataclass(frozen=True)
class DecodedImage:
    """An image that passed every check: its content's hash (what caches key on), size, format, RGB pixels."""

    digest: str
    width: int
    height: int
    format: str
    rgb: Any
    """A Pillow image in RGB mode."""


def data_url(media_type: str, data: str) -> str:
    """Anthropic's ``base64`` source as the ``data:`` URL chat parts carry."""
    return f"data:{media_type};base64,{data}"


def decode_all(refs: list[ImageRef], limits: ImageLimits) -> list[DecodedImage]:
    """Every image of a request, checked and decoded in order (a worker thread: decoding is CPU work)."""
    if len(refs) > limits.max_images:
        raise bad_request(f"the request holds {len(refs)} images; at most {limits.max_images} (--max-images)",
                          param=refs[0].where.split(".")[0], code="too_many_images")
    return [decode(ref, limits) for ref in refs]


def decode(ref: ImageRef, limits: ImageLimits) -> DecodedImage:
    """*ref*'s image, or the 400 that says what is wrong with it."""
    data = _bytes_of(ref, limits)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # the vision extra is not installed: nothing here reads images
        raise _invalid(ref, f"this server cannot read images ({INSTALL})") from exc
    if _looks_like_svg(data):
        raise _invalid(ref, "is an SVG image; send a raster format (PNG, JPEG, WebP, GIF, BMP)")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise _invalid(ref, f"is {width} x {height} pixels, more than {limits.max_pixels} "
                                    "(--max-image-pixels)", code="image_too_large")
            kind = str(image.format)
            image.load()
            rgb = image.convert("RGB")
    except UnidentifiedImageError as exc:
        raise _invalid(ref, f"is not an image in a supported format ({', '.join(FORMATS)})") from exc
    except Image.DecompressionBombError as exc:
        raise _invalid(ref, f"has more pixels than {limits.max_pixels} (--max-image-pixels)",
                       code="image_too_large") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's truncated or corrupt data
        raise _invalid(ref, "is truncated or corrupt and cannot be decoded") from exc
    return DecodedImage(hashlib.sha256(data).hexdigest(), width, height, kind, rgb)


def _bytes_of(ref: ImageRef, limits: ImageLimits) -> bytes:
    url = ref.url
    if ref.data is not None:  # fetched, within the bounds
        if not ref.data:
            raise _invalid(ref, "is empty")
        return ref.data
    if url.startswith(("http://", "https://")):
        raise _invalid(ref, "is an http(s) URL; this server does not fetch images (it would need "
                            "--allow-image-urls): send it inline, as a data: URL (base64)",
                       code="image_url_not_fetched")
    if not url.startswith("data:"):
        raise _invalid(ref, "must be a data: URL (data:image/png;base64,...)")
    header, comma, payload = url[5:].partition(",")
    media, *flags = header.split(";")
    if not comma or "base64" not in flags:
        raise _invalid(ref, "must be a base64 data: URL (data:image/png;base64,...)")
    if not media.lower().startswith("image/"):
        raise _invalid(ref, f"is a data: URL of type {media[:64]!r}, not an image")
    if len(payload) > (limits.max_bytes + 2) // 3 * 4 + 4:
        raise _invalid(ref, f"is more than {limits.max_bytes} bytes (--max-image-bytes)", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _invalid(ref, "is not valid base64") from exc
    if not data:
        raise _invalid(ref, "is empty")
    if len(data) > limits.max_bytes:
        raise _invalid(ref, f"is {len(data)} bytes, more than {limits.max_bytes} (--max-image-bytes)",
                       code="image_too_large")
    return data


def _looks_like_svg(data: bytes) -> bool:
    head = data[:512].lstrip().lower()
    return head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head)


def _invalid(ref: ImageRef, problem: str, code: str = "invalid_image") -> ApiError:
    return bad_request(f"{ref.where}: the image {problem}", param=ref.where.split(".")[0], code=code)
