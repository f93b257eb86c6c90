"""Screenshots of the page at ``GET /`` in each state of the MTP policy, for the docs (docs/page.md).

    python -m mlxcel.testing.page_shots [DIR]        # just page-shots; DIR: docs/page

Real servers (``mlxcel serve`` processes) on tiny checkpoints built here, a headless Chromium
(:mod:`.browser`), and real requests: ``unavailable`` (an MTP checkpoint served without ``--mtp``),
``profiling`` (two of four samples taken), ``settled`` (the same server after two more), ``forced``
(``MLXCEL_ENABLE_MTP_B1=1``) and ``exactness_declined`` (the tiny Qwen 3.6 MoE, whose verify this BLAS does not
multiply byte for byte as its classic step: on another BLAS it may profile instead, and the file is named by the
state it shows). Each shot is taken once the page shows the state the endpoint reports.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from .browser import chrome
from .serving import serve_subprocess

PROMPTS = ("def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "while True:")


def _shown(driver: Any, url: str, timeout: float = 60) -> str:
    """Wait until the page shows the state the endpoint reports; that state (a leaf's name)."""
    deadline = time.monotonic() + timeout
    while True:
        policy = httpx.get(f"{url}/v1/internal/mtp-policy", timeout=10).json()
        leaf = f"unavailable/{policy['reason']}" if policy["state"] == "unavailable" else policy["state"]
        if driver.execute_script("return document.body.dataset.policyState") == leaf:
            time.sleep(0.3)  # the poll's other panels are drawn in the same turn; let the frame paint
            return str(policy["state"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"the page did not show {leaf}")
        time.sleep(0.1)


@contextmanager
def _server(work: Path, name: str, args: list[str], env: dict[str, str]) -> Iterator[str]:
    with serve_subprocess(args, {"MLXCEL_CACHE_DIR": str(work / f"cache-{name}"), **env},
                          work / f"{name}.log") as url:
        yield url


def _ask(url: str, count: int, start: int = 0) -> None:
    for prompt in PROMPTS[start:start + count]:
        httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0},
                   timeout=120).raise_for_status()


def shoot(out: Path) -> list[Path]:
    """Write ``page-<state>.png`` under *out* for each state; the files written."""
    from ..families.qwen3_5.tiny import build_mtp_checkpoint
    from ..families.qwen3_5.tiny_vision import build_vision_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="mlxcel-page-shots-") as scratch:
        work = Path(scratch)
        target = build_mtp_checkpoint(work / "qwen35-tiny", drafter="aligned", context_scale=0.05)
        moe = build_vision_checkpoint(work / "qwen36-moe-tiny", moe=True, mtp=True)
        driver = chrome(1200, 1250)

        def shot(url: str) -> None:
            driver.get(url + "/")
            state = _shown(driver, url)
            path = out / f"page-{state}.png"
            driver.save_screenshot(str(path))
            written.append(path)
            print(f"wrote {path}")

        try:
            with _server(work, "unavailable", ["--model", str(target)], {}) as url:
                shot(url)
            with _server(work, "profiling", ["--model", str(target), "--mtp"],
                         {"MLXCEL_MTP_PROFILE_SAMPLES": "4"}) as url:
                _ask(url, 2)
                shot(url)
                _ask(url, 2, start=2)
                shot(url)
            with _server(work, "forced", ["--model", str(target), "--mtp"], {"MLXCEL_ENABLE_MTP_B1": "1"}) as url:
                _ask(url, 1)
                shot(url)
            with _server(work, "declined", ["--model", str(moe), "--mtp"], {}) as url:
                shot(url)
        finally:
            driver.quit()
    return written


if __name__ == "__main__":
    shoot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/page"))
