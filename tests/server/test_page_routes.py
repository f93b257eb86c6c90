"""The page's routes over real HTTP (no browser: tests/page drives one): what ``GET /`` answers to whom, the
files' headers and size, what the key gate leaves public, and the server status the page reads."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from mlxcel.page import ASSETS
from mlxcel.policy.statechart_svg import render_svg
from tests.server.conftest import server_on_a_thread

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


def test_a_browser_gets_the_page_and_everyone_else_the_json_index(hello_client: httpx.Client) -> None:
    page = hello_client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CSP
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["vary"] == "Accept"
    scripts = re.findall(r"<script[^>]*>", page.text)
    assert scripts == ['<script src="/page/page.js" defer>'], "no inline script"
    assert "style=" not in page.text and "<style" not in page.text, "no inline style"
    for accept in ("*/*", "application/json", None):
        headers = {"Accept": accept} if accept else {}
        index = hello_client.get("/", headers=headers)
        assert index.json()["name"] == "mlxcel" and index.headers["vary"] == "Accept", accept


def test_the_files_are_the_packages_small_and_fetch_nothing_from_elsewhere(hello_client: httpx.Client) -> None:
    total = len(hello_client.get("/", headers={"Accept": "text/html"}).content)
    for name, kind in ASSETS.items():
        answer = hello_client.get(f"/page/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"] == kind, name
        assert answer.headers["content-security-policy"] == CSP
        total += len(answer.content)
        external = set(re.findall(r"https?://[^\s\"')]+", answer.text)) - {"http://www.w3.org/2000/svg"}
        assert external == set(), (name, external)
    assert hello_client.get("/page/statechart.svg").text == render_svg()
    assert total < 64 * 1024, f"the page and its files are {total} bytes"
    assert hello_client.get("/page/nothing.js").status_code == 404
    assert hello_client.get("/page/%2e%2e%2fpyproject.toml").status_code == 404


def test_server_status_counts_requests_and_keeps_errors_without_their_content(hello_client: httpx.Client) -> None:
    before = hello_client.get("/v1/internal/server-status").json()
    answer = hello_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200
    bad = hello_client.post("/v1/chat/completions", content=b'{"messages": "secret words"')
    assert bad.status_code == 400
    status = hello_client.get("/v1/internal/server-status").json()
    assert status["state"] == "ready" and status["requests"]["slots"] >= 1
    assert status["requests"]["running"] == 0 and status["requests"]["queued"] == 0
    made = status["tokens"]["generated"] - before["tokens"]["generated"]
    # The counter counts every token the model made, its end-of-turn token too; usage counts the answer's.
    assert made == answer.json()["usage"]["completion_tokens"] + 1
    spans = status["generated_by_span"]
    assert spans["span_seconds"] == 5 and len(spans["counts"]) == 60 and 0 <= spans["current_span_seconds"] < 5
    # Over the last five minutes (this module's server is younger): every token made, by span.
    assert sum(spans["counts"]) == status["tokens"]["generated"]
    assert status["errors"][0] == {**status["errors"][0], "route": "/v1/chat/completions", "status": 400}
    assert "secret" not in str(status)


def test_with_a_key_the_page_is_public_and_its_data_is_not(hello_model: Path, tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(hello_model), "--api-key", "sesame"], env) as url, \
            httpx.Client(base_url=url) as client:
        assert client.get("/", headers={"Accept": "text/html"}).status_code == 200
        assert all(client.get(f"/page/{name}").status_code == 200 for name in ASSETS)
        for path in ("/v1/internal/server-status", "/v1/internal/mtp-policy", "/v1/cache/stats", "/v1/models"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200, path


def test_the_address_serve_logs_is_one_a_browser_on_this_host_can_open() -> None:
    from mlxcel.page import announce

    assert announce(["http://0.0.0.0:8080"]).startswith("the page: open http://127.0.0.1:8080/ in a browser")
    assert "http://[::1]:9000/ " in announce(["http://[::]:9000", "http://0.0.0.0:9000"])
    assert "http://192.168.1.5:8080/ " in announce(["http://192.168.1.5:8080"])


def test_no_path_under_the_page_opens_the_key_gate(hello_model: Path, tmp_path: Path) -> None:
    """Raw request targets (httpx would normalise them): only the page's own files are public."""
    import http.client

    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(hello_model), "--api-key", "sesame"], env) as url:
        host, port = url.removeprefix("http://").split(":")
        for target in ("/page/../v1/models", "/page/%2e%2e/v1/models", "/page/..%2fv1%2fmodels", "//page/page.js",
                       "/page/page.js/../../v1/models", "/page/", "/page/index.html", "/page/page.js?x=/v1/models"):
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request("GET", target)
            answer = connection.getresponse()
            body = answer.read()
            connection.close()
            if target.startswith(("/page/page.js?", "//page/page.js")):  # the page's own file, and only it
                assert answer.status == 200 and body.startswith(b"// mlxcel's page"), target
            else:
                assert answer.status in (401, 404), (target, answer.status)
                assert b'"object"' not in body, target


def test_a_server_of_several_models_shows_the_page_without_loading_one(hello_model: Path, tmp_path: Path) -> None:
    """The front answers the page itself: with the default model unloaded, neither the page nor its files load
    it (nor need its key gate), and the page's status calls name their model, so they load nothing either."""
    from mlxcel.testing.tools import build_scripted_checkpoint

    root = tmp_path / "models"
    build_scripted_checkpoint(root / "other", ("Another model.",))
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["--model", str(hello_model), "--model-dir", str(root), "--max-loaded", "1", "--api-key", "sesame"]
    auth = {"Authorization": "Bearer sesame"}
    with server_on_a_thread(argv, env) as url, httpx.Client(base_url=url, timeout=60) as client:
        said = client.post("/v1/chat/completions", headers=auth, json={
            "model": "other", "messages": [{"role": "user", "content": "hi"}]})
        assert said.status_code == 200, said.text

        def states() -> dict[str, str]:
            return {m["id"]: m["state"] for m in client.get("/v1/models", headers=auth).json()["data"]}

        assert states() == {"hello": "unloaded", "other": "loaded"}
        page = client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert all(client.get(f"/page/{name}").status_code == 200 for name in ASSETS)
        policy = client.get("/v1/internal/mtp-policy?model=hello", headers=auth).json()
        assert (policy["state"], policy["reason"]) == ("unavailable", "not_loaded")
        assert states() == {"hello": "unloaded", "other": "loaded"}
