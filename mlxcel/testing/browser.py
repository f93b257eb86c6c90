"""A headless Chromium driven by Selenium, for the page's tests and its screenshots (``mlxcel.testing.page_shots``).

Debian's ``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them): the driver is named, so
Selenium never looks for one on the network. ``MLXCEL_CHROMIUM`` and ``MLXCEL_CHROMEDRIVER`` name others.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> tuple[str, str] | None:
    """(browser, driver) paths, or None where either is missing."""
    browser = os.environ.get("MLXCEL_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM)), None)
    driver = os.environ.get("MLXCEL_CHROMEDRIVER") or shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def chrome(width: int = 1280, height: int = 1000) -> Any:
    """A headless Chromium of *width* x *height* whose console is kept (``driver.get_log("browser")``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    if found is None:
        raise RuntimeError("no Chromium and chromedriver here: apt-get install chromium chromium-driver")
    browser, driver = found
    options = Options()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)
