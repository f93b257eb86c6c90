"""Images named by an ``http(s)`` URL (:mod:`mlxcel.server.image_fetch`): fetched only where allowed, never from a
private address unless allowed, within the byte and time bounds, redirects checked hop by hop.

Model-free: the fetcher against a real HTTP server on this machine's loopback (the standard library's, on a
thread), whose log shows what was asked of it. A served vision model taking a fetched image is in
``test_qwen35_images.py``.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from PIL import Image

from mlxcel.http.errors import ApiError
from mlxcel.server.image_fetch import fetch_all
from mlxcel.server.images import ImageLimits, ImageRef, decode_all

PNG = io.BytesIO()
Image.new("RGB", (64, 48), (200, 30, 30)).save(PNG, format="PNG")
LIMITS = ImageLimits(max_bytes=1 << 20, fetch_urls=True, private_urls=True, fetch_seconds=2.0)


class _Images(BaseHTTPRequestHandler):
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).asked.append(self.path)
        routes = {"/cat.png": (200, PNG.getvalue(), {}), "/missing": (404, b"no", {}),
                  "/hop": (302, b"", {"Location": "/cat.png"}), "/loop": (302, b"", {"Location": "/loop"}),
                  "/away": (302, b"", {"Location": "ftp://example.com/cat.png"}),
                  "/big": (200, bytes(2 << 20), {})}
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/endless":  # no Content-Length: the bound is counted as the body arrives
            self.send_response(200)
            self.end_headers()
            with suppress(OSError):  # the fetcher hangs up once the body passes its bound
                for _ in range(64):
                    self.wfile.write(bytes(64 << 10))
            self.close_connection = True
            return
        status, body, headers = routes.get(self.path, (200, PNG.getvalue(), {}))
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        with suppress(OSError):  # a fetcher hangs up on a Content-Length over its bound ("/big") before the body
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def _refusal(url: str, limits: ImageLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await fetch_all([ImageRef("messages.0.content.1", url)], limits)
    assert caught.value.status == 400 and "messages.0.content.1" in caught.value.message
    return caught.value


async def test_a_fetched_image_is_the_inline_one(origin: str) -> None:
    fetched = await fetch_all([ImageRef("m", f"{origin}/cat.png"), ImageRef("n", f"{origin}/hop")], LIMITS)
    inline = decode_all([ImageRef("d", "data:image/png;base64," + base64.b64encode(PNG.getvalue()).decode())], LIMITS)
    assert [image.digest for image in decode_all(fetched, LIMITS)] == [inline[0].digest] * 2
    assert _Images.asked[-2:] == ["/hop", "/cat.png"]  # the redirect followed, its hop checked


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "10.1.2.3", "192.168.0.7", "169.254.169.254",
                                  "100.64.0.1", "0.0.0.0", "[fd00::1]", "[::ffff:127.0.0.1]", "224.0.0.1"])
async def test_no_private_or_loopback_address_is_asked(origin: str, host: str) -> None:
    asked = len(_Images.asked)
    port = origin.rsplit(":", 1)[1]
    refused = await _refusal(f"http://{host}:{port}/cat.png", replace(LIMITS, private_urls=False))
    assert refused.code == "image_url_refused" and "--allow-private-image-urls" in refused.message
    assert len(_Images.asked) == asked  # refused before any connection


@pytest.mark.parametrize(("path", "code", "says"), [
    ("/missing", "image_fetch_failed", "answered 404"),
    ("/loop", "image_fetch_failed", "redirected more than 3 times"),
    ("/away", "image_url_refused", "must be http or https"),
    ("/big", "image_too_large", "more than 1048576 bytes"),
    ("/endless", "image_too_large", "more than 1048576 bytes"),
])
async def test_each_failed_fetch_is_a_400_that_says_why(origin: str, path: str, code: str, says: str) -> None:
    refused = await _refusal(origin + path)
    assert refused.code == code and says in refused.message


async def test_a_slow_host_is_given_up_on(origin: str) -> None:
    started = time.monotonic()
    refused = await _refusal(f"{origin}/slow", replace(LIMITS, fetch_seconds=0.2))
    assert "took more than 0.2 s" in refused.message and time.monotonic() - started < 0.9


async def test_urls_are_not_fetched_unless_allowed(origin: str) -> None:
    asked = len(_Images.asked)
    refused = await _refusal(f"{origin}/cat.png", ImageLimits())
    assert refused.code == "image_url_not_fetched" and "--allow-image-urls" in refused.message
    for url in ("http://user:secret@example.com/a.png", "http:///a.png"):
        assert (await _refusal(url)).code == "image_url_refused"
    assert len(_Images.asked) == asked
    with pytest.raises(ApiError, match="at most 2"):  # counted before anything is fetched
        await fetch_all([ImageRef("m", f"{origin}/cat.png")] * 3, replace(LIMITS, max_images=2))
    assert len(_Images.asked) == asked


def test_private_addresses_alone_are_refused_at_start(tmp_path: Path) -> None:
    from mlxcel.cli import build_parser
    from mlxcel.serve_cli import build_serve_config
    from mlxcel.testing.checkpoints import build_checkpoint
    from mlxcel.usage import UsageError

    model = build_checkpoint(tmp_path / "llama-tiny", "llama")
    with pytest.raises(UsageError, match="--allow-private-image-urls widens --allow-image-urls: give both"):
        build_serve_config(build_parser().parse_args(["serve", "--port", "0", "--model", str(model),
                                                      "--allow-private-image-urls"]))
