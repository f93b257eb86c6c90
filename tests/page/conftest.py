"""The page's browser tests: one headless Chromium per module (``mlxcel.testing.browser``).

Marked ``browser`` (their modules' ``pytestmark``; ``pytest -m "not browser"`` leaves them out of the fast
loop). Without Chromium they skip, unless ``MLXCEL_REQUIRE_BROWSER=1`` (CI sets it, having installed Chromium):
then they fail, so CI cannot pass without running them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from mlxcel.testing.browser import chrome, find_browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if find_browser() is None:
        if os.environ.get("MLXCEL_REQUIRE_BROWSER") == "1":
            pytest.fail("MLXCEL_REQUIRE_BROWSER=1 but no chromium and chromedriver here", pytrace=False)
        pytest.skip("needs chromium and chromium-driver (apt-get install chromium chromium-driver)")
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


def leave_page(driver: Any) -> list[dict[str, Any]]:
    """The browser console's errors since the last call (a CSP violation is one), then the page left for
    ``about:blank``. Called while the page's server still runs: a page left open polls it, and once it stops
    every poll is a refused connection the console logs (flaky, and not the page's fault)."""
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    driver.get("about:blank")
    return errors
