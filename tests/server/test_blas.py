"""The BLAS mlx's CPU matmuls resolve to: ``MLXCEL_BLAS=mkl`` (Intel MKL from the ``mkl`` wheel).

A BLAS is chosen once per process, before mlx loads, so the MKL server runs in
a process of its own; this process keeps the suite's BLAS (OpenBLAS in CI).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from mlxcel import blas
from mlxcel.testing.serving import serve_subprocess

needs_mkl = pytest.mark.skipif(blas.mkl_library() is None or sys.platform != "linux",
                               reason="the mkl wheel is not installed (pip install 'mlxcel[mkl]')")


@needs_mkl
@pytest.mark.slow
def test_mkl_server_decodes_as_mlx_lm_and_labels_its_hardware(tmp_path: Path) -> None:
    from mlx_lm import generate, load

    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    target = build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned", context_scale=0.0)
    model, tokenizer = load(str(target))  # this process's BLAS: the oracle for the greedy tokens
    prompt = "The quick brown fox"
    expected = generate(model, tokenizer, prompt, max_tokens=12)
    env = {"MLXCEL_BLAS": "mkl", "MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with serve_subprocess(["--model", str(target), "--mtp"], env, tmp_path / "serve.log") as url:
        body = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                          timeout=60).json()
        policy = httpx.get(f"{url}/v1/internal/mtp-policy", timeout=10).json()
    log = (tmp_path / "serve.log").read_text()
    assert "Intel MKL" in log and "sequential layer" in log
    assert body["choices"][0]["text"] == expected
    assert policy["hardware"].startswith("cpu-mkl-")


def test_mkl_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "mkl_library", lambda: None)
    with pytest.raises(blas.BlasError, match=r"MLXCEL_BLAS=mkl: Intel MKL is not installed .*mlxcel\[mkl\]"):
        blas._load_mkl()


def test_mkl_library_is_found_in_the_environment_lib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmkl_rt.so.3").write_bytes(b"")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert blas.mkl_library() == tmp_path / "lib" / "libmkl_rt.so.3"
