"""The ``mlxcel serve`` options: the flags, their parsers and their help (:func:`add_serve_arguments`).

Each parser turns a bad value into argparse's one-line error; what the values mean together is
:mod:`mlxcel.serve_cli`'s to check.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .fleet import CatalogError, parse_duration


def _model_name(value: str) -> str:
    if not value or len(value) > 256 or not value.isprintable() or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"--served-model-name must be 1 to 256 printable characters without "
                                         f"spaces, not {value!r}")
    return value


def _positive(name: str, low: int = 1, high: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if number < low or (high is not None and number > high):
            accepted = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{name} must be an integer {accepted}, not {value!r}")
        return number
    return parse


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(value: str) -> int:
    """``--prompt-cache-bytes`` and ``--prompt-cache-disk-bytes``: a number of bytes, or of KiB, MiB, GiB, TiB
    with K, M, G, T (B optional)."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1] if text and text[-1] in "kmgt" else ""
    try:
        number = float(text[:-1] if unit else text)
    except ValueError:
        number = math.nan
    if not (0 <= number < 1 << 50):
        raise argparse.ArgumentTypeError(f"a size such as 512M or 8G, not {value!r}")
    return int(number * _UNITS[unit])


def default_prompt_cache_bytes() -> int:
    """An eighth of physical memory (1 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def default_prompt_cache_disk_bytes(cache_root: Path) -> int:
    """A tenth of the free space where the cache directory is (or would be), at most 64 GiB."""
    place = cache_root
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return min(64 << 30, shutil.disk_usage(place).free // 10)
    except OSError:
        return 0


def _seconds(name: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (0 < number <= 24 * 3600):
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds above 0 (at most a day), "
                                             f"not {value!r}")
        return number
    return parse


def _duration(value: str) -> float:
    try:
        return parse_duration(value, "--idle-unload")
    except CatalogError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[], metavar="DIR",
                        help="serve every checkpoint under DIR by name, loaded when first asked for: plain model "
                             "directories, Hugging Face's hub cache, LM Studio's ORG/NAME folders (repeatable)")
    parser.add_argument("--models", type=Path, metavar="FILE",
                        help="a TOML file of [[models]] tables: path, names (patterns allowed), mtp or draft, pin, "
                             "idle_unload and per-model options (docs/cli.md)")
    parser.add_argument("--max-loaded", type=_positive("--max-loaded"), default=None, metavar="N",
                        help="with several models: at most N loaded at once; the least recently used idle one "
                             "is unloaded to make room (default: no bound)")
    parser.add_argument("--memory-budget", type=_byte_size, default=None, metavar="SIZE",
                        help="what the server may hold, e.g. 24G: each model is charged its weights, its drafter's "
                             "and its prefix cache bound; a model that does not fit unloads idle ones first "
                             "(default: what this machine holds safely, printed at start)")
    parser.add_argument("--memory-wait", type=_seconds("--memory-wait"), default=120.0, metavar="SECONDS",
                        help="under a memory budget, how long a request waits for room for its sequences' caches "
                             "before a 503 (default: %(default)s)")
    parser.add_argument("--idle-unload", type=_duration, default=None, metavar="DURATION",
                        help="with several models: unload one idle this long, e.g. 10m (default: never)")
    drafter = parser.add_mutually_exclusive_group()
    drafter.add_argument("--mtp", action="store_true",
                         help="speculative decoding with the model's own in-checkpoint MTP head (mtp.* tensors)")
    drafter.add_argument("--draft-model", type=Path, metavar="DIR",
                         help="speculative decoding with the MTP drafter in DIR")
    parser.add_argument("--draft-block-size", type=str, default=None, metavar="K",
                        help="MTP verify width K (K-1 drafts per round; default MLXCEL_DRAFT_BLOCK_SIZE, else 4, "
                             "or 2 for the bundled model)")
    parser.add_argument("--draft-quantize", type=int, choices=[4, 8], default=None, metavar="BITS",
                        help="quantize the drafter's linear layers to 4 or 8 bits at load (default: as stored)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_positive("--port", 0, 65535), default=8080,
                        help="port to bind; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--parallel", type=_positive("--parallel"), default=4,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--max-queue-depth", type=_positive("--max-queue-depth", 0), default=16,
                        help="requests that may wait for a slot before 503 (default: %(default)s)")
    parser.add_argument("--no-batch", action="store_true",
                        help="one slot: one request at a time, no MTP")
    parser.add_argument("--served-model-name", action="append", type=_model_name, default=[], metavar="NAME",
                        help="a name a request's model may use (repeatable); the first is the one /v1/models lists "
                             "and answers name (default: the model directory's name, which stays accepted)")
    parser.add_argument("--prefill-step-size", type=_positive("--prefill-step-size", 16, 1 << 16), default=512,
                        metavar="TOKENS", help="prompt tokens prefilled per forward; a cancel or a new request is "
                                               "seen between chunks (default: %(default)s)")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, metavar="BITS",
                        help="quantize the KV cache to 4 or 8 bits (mlx-lm's quantized cache, group 64): less "
                             "memory per token of context; requests then decode one at a time (default: full "
                             "precision)")
    parser.add_argument("--max-tokens", type=_positive("--max-tokens"), default=512,
                        help="completion length when a request names none (default: %(default)s)")
    parser.add_argument("--prompt-cache-size", type=_positive("--prompt-cache-size", 0), default=None,
                        help="also bound the prompt prefix cache in entries; 0 turns it off (default: no bound "
                             "but --prompt-cache-bytes)")
    parser.add_argument("--prompt-cache-bytes", type=_byte_size, default=None, metavar="SIZE",
                        help="bytes of KV caches the prefix cache may hold, e.g. 512M or 8G (default: an eighth "
                             "of physical memory)")
    parser.add_argument("--prompt-cache-disk-bytes", type=_byte_size, default=None, metavar="SIZE",
                        help="bytes of prompt caches kept on disk, under the cache directory, across restarts; 0 "
                             "turns the disk tier off (default: a tenth of the disk's free space, at most 64G)")
    parser.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"), default=4 * 1024 * 1024,
                        help="largest request body accepted (default: %(default)s)")
    parser.add_argument("--max-images", type=_positive("--max-images"), default=16,
                        help="images in one request at most (default: %(default)s)")
    parser.add_argument("--max-image-bytes", type=_byte_size, default=5 * 1024 * 1024, metavar="SIZE",
                        help="bytes of one image at most, decoded from base64 (default: 5M, Anthropic's bound; the "
                             "body's own bound, --max-body-bytes, comes first)")
    parser.add_argument("--max-image-pixels", type=_positive("--max-image-pixels"), default=33_554_432,
                        help="pixels of one image at most, read from its header before it is decoded "
                             "(default: %(default)s, 32 megapixels)")
    parser.add_argument("--allow-image-urls", action="store_true",
                        help="fetch images named by an http(s) URL (off: only data: URLs), from public addresses "
                             "only, within --max-image-bytes and --image-fetch-timeout")
    parser.add_argument("--allow-private-image-urls", action="store_true",
                        help="with --allow-image-urls, fetch from loopback and private addresses too (a request "
                             "could then reach this machine's and its network's services)")
    parser.add_argument("--image-fetch-timeout", type=_seconds("--image-fetch-timeout"), default=10.0,
                        metavar="SECONDS", help="one image's whole fetch at most (default: %(default)s)")
    parser.add_argument("--max-connections", type=_positive("--max-connections"), default=1024,
                        help="open HTTP connections at most; at the limit the longest-idle one is closed "
                             "(default: %(default)s, lowered to fit the open-file limit)")
    parser.add_argument("--keep-alive-timeout", type=_seconds("--keep-alive-timeout"), default=5.0,
                        metavar="SECONDS", help="an idle keep-alive connection is closed after this long "
                                                "(default: %(default)s)")
    parser.add_argument("--send-timeout", type=_seconds("--send-timeout"), default=30.0, metavar="SECONDS",
                        help="a client that reads nothing of its answer for this long is disconnected and its "
                             "generation cancelled (default: %(default)s)")
    parser.add_argument("--access-log", action="store_true", help="log every request (hypercorn's access log)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEYS",
                        help="accepted API key(s), comma-separated; may repeat")
    parser.add_argument("--api-key-file", type=Path, help="file of accepted API keys, one per line")
    parser.add_argument("--props", action="store_true", help="mount GET /props")
    parser.add_argument("--slots", action="store_true", help="mount GET /slots")
    parser.add_argument("--metrics", action="store_true", help="mount GET /metrics (Prometheus)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--distributed", choices=["pipeline", "tensor"], default=None,
                        help="shard the model across the processes mlx.launch started (mlx-lm's pipeline or "
                             "tensor parallelism); rank 0 serves HTTP (docs/scaling.md)")
    from .router.options import add_router_arguments

    add_router_arguments(parser)
