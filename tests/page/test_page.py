"""The page at ``GET /`` in a real browser (headless Chromium), against live in-process servers.

What a person sees: the statechart with the policy's state lit, following the endpoint from ``profiling`` to
``settled`` as requests arrive; the key asked for once and a wrong one refused; a model name that holds markup
shown as text; a router's nodes. No console error anywhere (a blocked script or style under the page's
Content-Security-Policy is one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.page.conftest import leave_page
from tests.server.conftest import hold_the_batch_probe, server_on_a_thread

pytestmark = pytest.mark.browser


def _until(condition: Callable[[], Any], timeout: float = 30, what: str = "the page") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # a real browser polls on its own clock: nothing to fake here


def _lit(driver: Any) -> list[str]:
    return [node.get_attribute("data-state") for node in driver.find_elements(By.CSS_SELECTOR, "#statechart .current")]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("page") / "qwen35-page", drafter="aligned",
                                context_scale=0.05)


def test_the_statechart_follows_the_policy_from_profiling_to_settled(browser: Any, mtp_model: Path,
                                                                      tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache"), "MLXCEL_MTP_PROFILE_SAMPLES": "2"}
    with server_on_a_thread(["--model", str(mtp_model), "--mtp", "--port", "0"], env) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        browser.get(url + "/")
        _until(lambda: browser.execute_script("return document.body.dataset.policyState") == "profiling",
               what="the page to show profiling")
        assert client.get("/v1/internal/mtp-policy").json()["state"] == "profiling"
        assert _lit(browser) == ["profiling"]
        assert browser.find_element(By.ID, "policy-facts").text.startswith("State\nprofiling")
        for prompt in ("def wrap(text, width=70):", "class Template:"):
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0})
            assert answer.status_code == 200, answer.text
        policy = client.get("/v1/internal/mtp-policy").json()
        assert policy["state"] == "settled"
        _until(lambda: browser.execute_script("return document.body.dataset.policyState") == "settled",
               what="the page to show settled")
        assert _lit(browser) == ["settled"]
        facts = browser.find_element(By.ID, "policy-facts").text
        assert f"Verdict\n{policy['verdict']}" in facts and "Samples\n2 of 2" in facts
        assert f"{mtp_model.name} · {mtp_model.name}#mtp · {policy['hardware']} · K={policy['block_size']}" in facts
        rows = browser.find_elements(By.CSS_SELECTOR, "#samples-table tr")
        assert len(rows) >= 2  # a header and the samples seen (the page watched the last one arrive)
        assert "Tokens\n" in browser.find_element(By.ID, "server-facts").text
        assert leave_page(browser) == []


def test_a_start_shows_what_it_is_doing_until_it_serves(browser: Any, mtp_model: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A large pairing's start takes a minute: while it loads the page says what it is doing (``/health``'s
    ``loading``, the start's last progress line), and drops the line once the server serves. The batch's
    exactness probe is held (the real one, run once released) so that the page sees the start mid-way."""
    probing, release = hold_the_batch_probe(monkeypatch)
    caplog.set_level(logging.INFO, logger="mlxcel")  # `mlxcel serve`'s default level
    try:
        with server_on_a_thread(["--model", str(mtp_model), "--mtp", "--port", "0"],
                                {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}, ready=False) as url:
            assert probing.wait(30)
            browser.get(url + "/")
            line = _until(lambda: browser.find_element(By.ID, "server-loading").text, what="the start's line")
            assert line == "MTP batch exactness probe: checking each batch width 2..5 against the batch's classic steps"
            assert browser.find_element(By.ID, "server-status").text == "loading"
            release.set()
            _until(lambda: browser.find_element(By.ID, "server-status").text == "ok", what="the page to show ok")
            assert not browser.find_element(By.ID, "server-loading").is_displayed()
            errors = leave_page(browser)  # its polls while loading were answered 503, which the console logs
            assert all("status of 503" in e["message"] for e in errors), errors  # and nothing else
    finally:
        release.set()  # however the test ends, the held start goes on (and the server can stop)


def test_the_key_is_asked_for_once_and_a_wrong_one_is_refused(browser: Any, mtp_model: Path,
                                                              tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(mtp_model), "--port", "0", "--api-key", "sesame"], env) as url:
        browser.get(url + "/")
        browser.execute_script("sessionStorage.clear()")
        browser.refresh()
        form = browser.find_element(By.ID, "key-form")
        _until(form.is_displayed, what="the key form")
        field = browser.find_element(By.ID, "key-input")
        field.send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        _until(lambda: "refused" in browser.find_element(By.ID, "key-error").text, what="the refusal")
        field.clear()
        field.send_keys("sesame")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        _until(lambda: browser.execute_script("return document.body.dataset.policyState") == "unavailable/"
               "no_mtp_dispatch", what="the policy behind the key")
        assert not form.is_displayed()
        browser.refresh()  # the same tab keeps the key: no second prompt
        _until(lambda: browser.execute_script("return document.body.dataset.loaded") == "yes", what="the reload")
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        assert _lit(browser) == ["unavailable", "unavailable/no_mtp_dispatch"]
        assert "sesame" not in browser.current_url and browser.get_cookies() == []
        errors = leave_page(browser)
    # The wrong key's 401s are the only errors the console may hold (Chromium logs a failed fetch).
    assert all("401" in entry["message"] for entry in errors), errors


def test_a_model_name_holding_markup_is_shown_as_text(browser: Any, mtp_model: Path, tmp_path: Path) -> None:
    name = "<img/src=x/onerror=alert(1)>"
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(mtp_model), "--port", "0", "--served-model-name", name], env) as url:
        browser.get(url + "/")
        _until(lambda: browser.execute_script("return document.body.dataset.loaded") == "yes")
        assert browser.find_element(By.ID, "server-name").text == name
        assert name in browser.find_element(By.ID, "models-table").text
        assert browser.find_elements(By.TAG_NAME, "img") == []
        assert browser.execute_script("return document.querySelectorAll('[onerror]').length") == 0
        assert leave_page(browser) == []


def test_a_routers_page_lists_its_nodes(browser: Any, mtp_model: Path, tmp_path: Path) -> None:
    from tests.router.conftest import router_on_a_thread, wait_for_every_node

    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(mtp_model), "--port", "0"], env) as node, \
            router_on_a_thread(["--node-role", "router", "--backend", node]) as router:
        wait_for_every_node(router, 1)
        browser.get(router.url + "/")
        _until(lambda: browser.execute_script("return document.body.dataset.loaded") == "yes")
        assert browser.find_element(By.ID, "router-section").is_displayed()
        assert not browser.find_element(By.ID, "policy-section").is_displayed()
        rows = browser.find_elements(By.CSS_SELECTOR, "#nodes-table tr")
        assert len(rows) == 2 and rows[1].text.startswith("node-0 yes 0 0 0 unavailable")
        assert "1 of 1 healthy" in browser.find_element(By.ID, "router-facts").text
        assert leave_page(browser) == []


def test_with_several_models_the_menu_picks_whose_policy_is_shown(browser: Any, mtp_model: Path,
                                                                 tmp_path: Path) -> None:
    from selenium.webdriver.support.select import Select

    from mlxcel.testing.tools import build_scripted_checkpoint

    root = tmp_path / "models"
    build_scripted_checkpoint(root / "other", ("Another model.",))
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(mtp_model), "--model-dir", str(root), "--port", "0"], env) as url:
        browser.get(url + "/")
        _until(lambda: browser.execute_script("return document.body.dataset.loaded") == "yes")
        models = browser.find_element(By.ID, "models-table").text
        assert f"{mtp_model.name} loaded" in models and "other unloaded" in models
        menu = Select(browser.find_element(By.ID, "model-select"))
        assert [option.text for option in menu.options] == [mtp_model.name, "other"]
        menu.select_by_visible_text("other")
        _until(lambda: browser.execute_script("return document.body.dataset.policyState") == "unavailable/not_loaded",
               what="the unloaded model's policy")
        assert _lit(browser) == ["unavailable"]  # not a state of the statechart: no box of its own
        menu.select_by_visible_text(mtp_model.name)
        _until(lambda: browser.execute_script("return document.body.dataset.policyState") == "unavailable/"
               "no_mtp_dispatch", what="the default model's policy")
        assert leave_page(browser) == []
