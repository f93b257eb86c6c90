"""Images named by an ``http(s)`` URL, fetched only where the server is told to (``--allow-image-urls``).

A server that fetches whatever URL a request names is a hole into the network it sits on (server-side request
forgery: the cloud's metadata service at 169.254.169.254, an admin page on localhost, a database on the LAN). So:

- off by default: an ``http(s)`` URL is a 400 ``image_url_not_fetched`` that names the flag;
- the host is resolved here, and every address it resolves to must be a public one (``ipaddress``'s
  ``is_global``: loopback, private, link-local, shared, reserved and IPv4-mapped private addresses refused) unless
  ``--allow-private-image-urls``; the connection then goes to that checked address (the request keeps its
  ``Host`` header and TLS name), so a second lookup cannot answer otherwise (DNS rebinding);
- redirects are followed by hand, at most :data:`MAX_REDIRECTS`, each hop checked as the first;
- at most ``--max-image-bytes`` read (a ``Content-Length`` above it is refused before the body), and the whole
  fetch, redirects included, within ``--image-fetch-timeout`` seconds;
- no proxy or credentials from the environment, no cookies.

What comes back is checked as any inline image is (:func:`~mlxcel.server.images.decode`). httpx is the client
(maintained, and it lets a request pin its address while keeping its TLS server name), its synchronous one on a
worker thread: an async stream cut short by a bound leaves httpx's inner async generators unclosed under trio.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from contextlib import closing
from dataclasses import replace

import httpx
import trio

from ..http.errors import ApiError, bad_request
from .images import ImageLimits, ImageRef

MAX_REDIRECTS = 3
_USER_AGENT = "mlxcel-image-fetch"


def _refused(ref: ImageRef, problem: str, code: str = "image_url_refused") -> ApiError:
    return bad_request(f"{ref.where}: the image URL {problem}", param=ref.where.split(".")[0], code=code)


async def fetch_all(refs: list[ImageRef], limits: ImageLimits) -> list[ImageRef]:
    """*refs* with every ``http(s)`` URL's bytes fetched (in order, one at a time), or the 400 for the first that
    cannot be; ``data:`` URLs pass through untouched."""
    if len(refs) > limits.max_images:  # counted before anything is fetched
        raise bad_request(f"the request holds {len(refs)} images; at most {limits.max_images} (--max-images)",
                          param=refs[0].where.split(".")[0], code="too_many_images")
    out = []
    for ref in refs:
        if not ref.url.startswith(("http://", "https://")):
            out.append(ref)
        elif not limits.fetch_urls:
            raise _refused(ref, "is an http(s) URL, and this server does not fetch images (it would need "
                                "--allow-image-urls): send it inline, as a data: URL (base64)",
                           code="image_url_not_fetched")
        else:  # abandoned if the request is cancelled: the thread ends within the fetch's own bound
            out.append(replace(ref, data=await trio.to_thread.run_sync(fetch, ref, limits, abandon_on_cancel=True)))
    return out


def fetch(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The bytes at *ref*'s URL, within *limits* (module docstring); on a worker thread: httpx's synchronous
    client, whose streams close cleanly when a bound cuts them short."""
    deadline = time.monotonic() + limits.fetch_seconds
    try:
        with httpx.Client(trust_env=False, follow_redirects=False, timeout=limits.fetch_seconds) as client:
            url = _parsed(ref, ref.url)
            for _ in range(MAX_REDIRECTS + 1):
                address = _checked_address(ref, url, limits.private_urls)
                request = client.build_request(
                    "GET", url.copy_with(host=address),
                    headers={"Host": url.netloc.decode("ascii"), "User-Agent": _USER_AGENT, "Accept": "image/*"},
                    extensions={"sni_hostname": url.host})
                with closing(client.send(request, stream=True)) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = _parsed(ref, str(url.join(response.headers["location"])))
                        continue
                    return _body(ref, response, url, limits.max_bytes, deadline)
            raise _refused(ref, f"redirected more than {MAX_REDIRECTS} times", code="image_fetch_failed")
    except (httpx.TimeoutException, TimeoutError) as exc:
        raise _refused(ref, f"took more than {limits.fetch_seconds:g} s to fetch (--image-fetch-timeout)",
                       code="image_fetch_failed") from exc
    except httpx.HTTPError as exc:
        raise _refused(ref, f"could not be fetched: {type(exc).__name__}", code="image_fetch_failed") from exc


def _parsed(ref: ImageRef, text: str) -> httpx.URL:
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as exc:
        raise _refused(ref, "is not a valid URL") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise _refused(ref, f"must be http or https with a host (a redirect to {url.scheme or 'nothing'}: refused)")
    if url.userinfo:
        raise _refused(ref, "may not carry credentials")
    return url


def _checked_address(ref: ImageRef, url: httpx.URL, private_allowed: bool) -> str:
    """The address to connect to for *url*: every address its host resolves to checked (module docstring)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _refused(ref, f"names a host that does not resolve ({url.host})", code="image_fetch_failed") from exc
    addresses = [ipaddress.ip_address(str(entry[4][0]).split("%")[0]) for entry in found]
    if not addresses:
        raise _refused(ref, f"names a host that does not resolve ({url.host})", code="image_fetch_failed")
    if not private_allowed:
        for address in addresses:
            mapped = getattr(address, "ipv4_mapped", None) or address
            if not mapped.is_global or mapped.is_multicast:
                raise _refused(ref, f"names {url.host}, which is a private, loopback or reserved address "
                                    f"({address}); the server fetches only from public addresses (unless "
                                    "--allow-private-image-urls)")
    return str(addresses[0])


def _body(ref: ImageRef, response: httpx.Response, url: httpx.URL, max_bytes: int, deadline: float) -> bytes:
    if response.status_code != 200:
        raise _refused(ref, f"could not be fetched: {url.host} answered {response.status_code}",
                       code="image_fetch_failed")
    too_large = f"is more than {max_bytes} bytes (--max-image-bytes)"
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _refused(ref, f"names an image that {too_large}", code="image_too_large")
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > max_bytes:
            raise _refused(ref, f"names an image that {too_large}", code="image_too_large")
        if time.monotonic() > deadline:  # a slow drip: each read within the bound, the whole not
            raise TimeoutError
    return bytes(data)
