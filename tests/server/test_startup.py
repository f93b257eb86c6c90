"""Bad files and options at start, through the real command line: one line, exit status 2, before binding.

A refusal is decided before anything process-wide, so most run the command line's entry point in this
process, as do the starts whose log is the subject (:func:`_served`); a process of its own runs the console
script end to end, the cases a regression would block (a FIFO), and the starts whose subject is the process
(its open-file limit, its exit status after binding).

Tests run as root, for whom no permission bit makes a file unreadable, so the
unreadable files here are a directory, a dangling link or a FIFO where a file
should be: each raises (or, for a FIFO, would block in) ``open``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from mlxcel.cli import build_parser
from mlxcel.testing.serving import IMPORT_STRUCTURES, child_env, free_port, wait_healthy
from tests.server.conftest import cli, mlxcel, refused, stoppable_server

if TYPE_CHECKING:
    from mlxcel.fleet.serve import FleetConfig
    from mlxcel.serve import ServeConfig


def _one_error_line(status: int | str | None, stderr: str) -> str:
    assert status == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mlxcel")]
    assert len(lines) == 1, stderr
    assert "listening" not in stderr and "Running on" not in stderr
    return lines[0]


def _exited(*argv: str) -> str:
    """The one line a `mlxcel` process writes as it exits 2: a new interpreter, for the console script
    end to end and for the cases a regression would block (opening a FIFO), which must fail this test
    (the child's timeout), not stall the test run."""
    result = mlxcel(*argv, timeout=60)
    return _one_error_line(result.returncode, result.stderr)


def _refused(*argv: str) -> str:
    """The one line `mlxcel serve *argv*` refuses with, from the command line's entry point in this process
    (:func:`tests.server.conftest.refused`: what a new interpreter adds is its imports)."""
    return _one_error_line(2, refused(*argv))


def _broken_weights(llama: Path, root: Path, kind: str) -> Path:
    model = root / kind
    shutil.copytree(llama, model)
    weights = model / "model.safetensors"
    weights.unlink()
    if kind == "directory":
        weights.mkdir()
    elif kind == "dangling-link":
        weights.symlink_to(root / "nowhere.safetensors")
    else:
        os.mkfifo(weights)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "dangling-link", "fifo"])
def test_unreadable_weights_exit_2(llama: Path, tmp_path: Path, kind: str) -> None:
    model = _broken_weights(llama, tmp_path, kind)
    argv = ("--model", str(model))
    line = _exited("serve", *argv, "--port", str(free_port())) if kind == "fifo" else _refused(*argv)
    assert f"{model / 'model.safetensors'} is not a regular file" in line


@pytest.mark.slow
def test_unreadable_tokenizer_exits_2(llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(tmp_path / "nowhere.json")
    line = _refused("--model", str(model))
    assert "has no tokenizer" in line


@pytest.mark.slow
def test_model_that_is_a_file_says_so(llama: Path) -> None:
    # Through a process of its own, as every refusal once was: the console script's exit status and stderr.
    line = _exited("serve", "--model", str(llama / "config.json"), "--port", str(free_port()))
    assert "is not a directory" in line and "does not exist" not in line


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "expected"), [
    ("latin-1", "is not UTF-8 text"),
    ("fifo", "is not a regular file"),
    ("directory", "is not a regular file"),
    ("missing", "No such file or directory"),
])
def test_bad_api_key_file_exits_2(llama: Path, tmp_path: Path, kind: str, expected: str) -> None:
    keys = tmp_path / "keys"
    if kind == "latin-1":
        keys.write_bytes("clé\n".encode("latin-1"))
    elif kind == "fifo":
        os.mkfifo(keys)
    elif kind == "directory":
        keys.mkdir()
    argv = ("--model", str(llama), "--api-key-file", str(keys))
    line = _exited("serve", *argv, "--port", str(free_port())) if kind == "fifo" else _refused(*argv)
    assert f"--api-key-file {keys}" in line and expected in line


@pytest.mark.parametrize(("option", "value"), [
    ("--port", "70000"), ("--port", "-1"), ("--max-connections", "0"),
    ("--keep-alive-timeout", "0"), ("--keep-alive-timeout", "soon"), ("--send-timeout", "-1"),
    ("--prompt-cache-bytes", "lots"), ("--prompt-cache-bytes", "5Q"), ("--prefill-step-size", "8"),
])
def test_out_of_range_options_are_refused_at_parse(option: str, value: str) -> None:
    line = _refused("--model", "/nonexistent", option, value)
    assert line.startswith(f"mlxcel serve: argument {option}: ") and repr(value) in line


def _serve_until_ready(args: list[str], env: dict[str, str], log: Path, *, nofile: tuple[int, int] | None = None,
                       while_ready: Callable[[int, int], None] | None = None) -> tuple[int, str]:
    """Start `mlxcel serve`, wait for /health 200 (30 s at most), run *while_ready(port, pid)*, SIGTERM it.

    *nofile*: the (soft, hard) open-file limit the process starts with. Returns (exit status, log).
    """
    port = free_port()
    with log.open("w") as out, subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=child_env(env),
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile),
    ) as process:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, 30, log)
            if while_ready is not None:
                while_ready(port, process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(timeout=30)
            finally:
                process.kill()
    return status, log.read_text()


def _served(caplog: pytest.LogCaptureFixture, *argv: str) -> tuple[object, str]:
    """`mlxcel serve *argv*` through the command line's entry point in this process (:func:`cli`), its server
    run until ``/health`` answers 200 and then stopped as SIGTERM stops it. Returns (exit status, its log: what it
    logged at the command line's default ``--log-level``, a line a record, and its stderr).

    For the starts whose log is the subject: nothing process-wide (the BLAS, signals, the open-file limit) is,
    so a new interpreter would add only its imports.
    """
    import mlxcel.serve

    async def until_ready(config: ServeConfig | FleetConfig) -> None:  # serve.main, less signals and open-file limit
        async with stoppable_server(config):
            pass

    level = getattr(logging, build_parser().parse_args(["serve"]).log_level.upper())
    seen = len(caplog.records)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(level):
        patch.setattr(mlxcel.serve, "main", until_ready)
        status, stderr = cli("serve", "--port", "0", *argv)
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records[seen:]]
    return status, "\n".join([*lines, stderr])


@pytest.mark.slow
def test_a_fifo_at_the_hint_path_is_ignored_with_a_warning(tmp_path: Path) -> None:
    from mlxcel.hardware import detect_host
    from mlxcel.policy import PairingKey
    from mlxcel.policy.hints import HINT_DIR
    from mlxcel.serve_cli import BUNDLED_BLOCK_SIZE, BUNDLED_MODEL

    # The bundled pairing's hint. ALLOW_INEXACT: the hint is read even where the exactness probe vetoes.
    key = PairingKey(BUNDLED_MODEL.name, f"{BUNDLED_MODEL.name}#mtp", detect_host().label, BUNDLED_BLOCK_SIZE)
    hint = tmp_path / "cache" / HINT_DIR / f"{key.digest()}.json"
    hint.parent.mkdir(parents=True)
    os.mkfifo(hint)
    status, log = _serve_until_ready([], {"MLXCEL_CACHE_DIR": str(tmp_path / "cache"),
                                          "MLXCEL_MTP_ALLOW_INEXACT": "1"}, tmp_path / "serve.log")
    assert status == 0, log
    assert f"ignoring the MTP policy hint {hint}: it is not a regular file" in log


@pytest.mark.slow
@pytest.mark.parametrize(("args", "warning"), [
    (["--draft-block-size", "3"], "--draft-block-size 3 has no effect without a drafter"),
    (["--no-batch", "--mtp"], "--no-batch has no MTP path: --mtp is ignored"),
], ids=["block-size-without-drafter", "no-batch-mtp"])
def test_ignored_option_combinations_warn_once(llama: Path, caplog: pytest.LogCaptureFixture, args: list[str],
                                               warning: str) -> None:
    model = ["--model", str(llama)] if "--mtp" not in args else []  # the bundled model has an MTP head
    status, log = _served(caplog, *model, *args)
    assert status == 0, log
    assert len([line for line in log.splitlines() if warning in line]) == 1, log
    assert "MTP drafter:" not in log


@pytest.mark.slow
def test_access_log_is_off_by_default_and_on_with_the_flag(llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, quiet = _served(caplog, "--model", str(llama))
    _, logged = _served(caplog, "--model", str(llama), "--access-log")
    assert "GET /health" not in quiet
    assert any("hypercorn.access" in line and '"GET /health 1.1" 200' in line for line in logged.splitlines()), logged


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
@pytest.mark.parametrize("served", ["llama", "the bundled pairing, with its drafter"])
def test_the_soft_open_file_limit_is_raised_to_the_hard_one(llama: Path, tmp_path: Path, served: str) -> None:
    # Importing mlx-lm lowers the limit, or fails under a hard limit below 4096, unless mlxcel disarms it:
    # the drafter's path imports mlx-lm too, so both are started.
    seen: list[tuple[int, int]] = []
    args = ["--model", str(llama)] if served == "llama" else []
    _, log = _serve_until_ready(args, {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")},
                                tmp_path / "serve.log", nofile=(256, 1500),
                                while_ready=lambda _port, pid: seen.append(_open_files_limit(pid)))
    assert seen == [(1500, 1500)], log
    assert "does not fit the open-file limit" not in log  # 1024 connections + 128 fit in 1500


@pytest.mark.slow
def test_idle_connections_past_the_open_file_limit_do_not_starve_health(llama: Path, tmp_path: Path) -> None:
    """The reported failure: idle keep-alive connections used every descriptor and nothing was answered."""
    idle_count, limit = 400, 300
    health_seconds: list[float] = []

    def flood(port: int, _pid: int) -> None:
        idle = []
        try:
            for _ in range(idle_count):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                connection.request("GET", "/")
                assert connection.getresponse().read()
                idle.append(connection)  # kept open: an idle keep-alive connection
            started = time.monotonic()
            health = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            health.request("GET", "/health")
            assert health.getresponse().status == 200
            health_seconds.append(time.monotonic() - started)
            health.close()
        finally:
            for connection in idle:
                connection.close()

    status, log = _serve_until_ready(["--model", str(llama), "--keep-alive-timeout", "60"],
                                     {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}, tmp_path / "serve.log",
                                     nofile=(limit, limit), while_ready=flood)
    assert status == 0, log
    assert f"--max-connections 1024 does not fit the open-file limit {limit}" in log
    assert health_seconds and health_seconds[0] < 2, health_seconds


def test_a_model_that_fails_to_load_after_binding_exits_2_with_one_line(llama: Path, tmp_path: Path) -> None:
    # The headers are fine (inspected before binding); the weights do not fit the config, which only
    # the real load on the worker finds.
    broken = tmp_path / "llama-misfit"
    shutil.copytree(llama, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    result = mlxcel("serve", "--model", str(broken), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("mlxcel serve:")]
    assert line.startswith(f"mlxcel serve: stopped: cannot load {broken}")


def test_test_servers_import_what_a_users_install_has_no_torch() -> None:
    # The dev extra installs torch for the parity references; a child started with child_env must not see
    # it (transformers would import it on the way to AutoTokenizer), and must load a tokenizer without it.
    script = ("import sys, importlib.util; from transformers import AutoTokenizer; "
              "print(importlib.util.find_spec('torch'), sys.modules.get('torch'))")
    hidden = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True,
                            timeout=120, check=True)
    assert hidden.stdout.split() == ["None", "None"], hidden.stderr


def test_test_servers_read_transformers_import_structure_as_they_would_scan_it() -> None:
    # Each child reads the test process's scan of transformers' files (child_site/sitecustomize.py) instead of
    # scanning them at its start: the structure a child with torch hidden scans for itself, and no scan.
    script = ("import pickle, sys, pathlib, transformers; from transformers import AutoTokenizer; "
              "from transformers.utils import import_utils; scan = import_utils.create_import_structure_from_path; "
              "models = pathlib.Path(transformers.__file__).parent / 'models'; "
              "sys.stdout.buffer.write(pickle.dumps((hasattr(scan, 'cache_info'), scan(models))))")
    shared, scanned = (pickle.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                                   timeout=120, check=True).stdout)
                       for env in (child_env(), {**child_env(), IMPORT_STRUCTURES: ""}))
    assert (shared[0], scanned[0]) == (False, True)  # lru_cache's wrapper: transformers' own scanner
    assert shared[1] == scanned[1] and len(shared[1]) > 1


def test_a_start_refused_before_binding_does_not_wait_for_mlx_lm(llama: Path, tmp_path: Path) -> None:
    # mlx-lm's package imports transformers (and torch, where installed): seconds a refusal need not take.
    script = ("import sys; from mlxcel.cli import main; "
              f"status = main(['serve', '--model', {str(llama)!r}, '--api-key-file', {str(tmp_path / 'none')!r}]); "
              "print(status, 'mlx_lm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "cannot read --api-key-file" in done.stderr


@pytest.mark.parametrize("role", ["node", "router"])
def test_key_options_that_name_no_key_are_refused(llama: Path, tmp_path: Path, role: str) -> None:
    comments = tmp_path / "keys"
    comments.write_text("# no key yet\n\n")
    served = ["--model", str(llama)] if role == "node" else ["--node-role", "router", "--backend", "http://127.0.0.1:9"]
    for keys in (["--api-key", " , "], ["--api-key-file", str(comments)]):
        assert "--api-key/--api-key-file given, but no key in them" in refused(*served, *keys)
