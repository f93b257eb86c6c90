"""Shared fixtures: hosts, pairings, a cache root, and the published v1 JSON Schema."""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mlxcel.blas import blas_kind, load_fast_blas

# Before anything imports mlx: the fast BLAS, as `mlxcel serve` does.
load_fast_blas()

# Every httpx client (the tests', the openai and anthropic SDKs', a test router's) builds an SSL
# context, parsing the whole trust store (certifi's, or SSL_CERT_FILE's) each time: ~30 ms a client,
# and the suite makes ~1,700, every one to a plain-http server on 127.0.0.1. A CA *directory* is read
# only at a TLS handshake, which none of them makes (one that tried would fail to verify: tests reach
# no network). httpx reads both variables from the environment, and the tests' children inherit it.
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = "/nonexistent/mlxcel-tests-make-no-tls-connections"

from mlxcel.policy import HintStore, HostInfo, PairingKey  # noqa: E402
from mlxcel.testing.serving import share_import_structures  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "mtp-policy-v1.schema.json").read_text())
jsonschema.Draft202012Validator.check_schema(SCHEMA)
# Built once: jsonschema.validate re-checks the schema itself on every call,
# which dominated the property tests' time.
_WIRE_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

APPLE_M5 = HostInfo(label="M5-16c", gpu_vendor="Apple", gpu_device="Apple M5",
                    gpu_architecture="applegpu_g17p", static_mtp_gate=True)
LINUX_CPU = HostInfo(label="cpu-openblas-x86_64-Unknown-0c", gpu_vendor="Unknown", gpu_device=None,
                     gpu_architecture=None, static_mtp_gate=False)


def validate_wire(body: dict[str, Any]) -> None:
    """Fail unless *body* conforms to the published schema-v1 JSON Schema."""
    _WIRE_VALIDATOR.validate(body)


_CHILD_FILES = tempfile.TemporaryDirectory(prefix="mlxcel-tests-")


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a process that runs tests (xdist's controller collects none), once the tests are known:

    - transformers' import structure is scanned here once and shared with every child a test starts (dozens of
      ``mlxcel serve`` processes, each of which would scan ~3,400 files at start: ~0.75 s; see
      :func:`mlxcel.testing.serving.share_import_structures`);
    - what collection made (every test item, every module the test modules import) lives to the session's end:
      frozen out of the garbage collector's reach, so a full collection no longer walks it (~375k objects,
      ~0.25 s each time; the fleet's unload runs one, ``mlxcel.fleet.slot.release_memory``). What a test makes
      later is collected as before."""
    share_import_structures(Path(_CHILD_FILES.name))
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    _CHILD_FILES.cleanup()


def _torch_on_one_thread() -> None:
    """torch (the parity references, and the reference classes that build the tiny checkpoints) on one thread.

    Its default, a thread a core, waits at every op's end for a thread whose core the other xdist worker
    holds, spinning meanwhile: one 32-token transformers ``generate`` of the Inkling reference took 7.6 s of
    CPU on two threads and 0.49 s on one. Not ``OMP_NUM_THREADS``: the servers' processes would inherit it,
    and OpenBLAS reads it. torch arrives with mlx-lm's import (transformers imports it where installed),
    so at the first test it is there, and nothing here imports it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures, which may build checkpoints with torch
def pytest_runtest_setup(item: pytest.Item) -> None:
    """torch on one thread (:func:`_torch_on_one_thread`); ``requires_openblas``: skip without the system
    OpenBLAS, unless CI requires it.

    Some behaviour only exists with OpenBLAS (it multiplies 4+ rows with another
    kernel, which is what makes a genuinely inexact pairing). `.ci/run` installs
    it and sets ``MLXCEL_REQUIRE_OPENBLAS=1``, so there those tests fail rather
    than silently disappear.
    """
    _torch_on_one_thread()
    if item.get_closest_marker("requires_mkl") is not None:
        from mlxcel.blas import mkl_library

        if mkl_library() is None:
            if os.environ.get("MLXCEL_REQUIRE_OPENBLAS") == "1":
                pytest.fail("MLXCEL_REQUIRE_OPENBLAS=1 but the mkl wheel is not installed (the dev extra "
                            "installs it on Linux x86_64)", pytrace=False)
            pytest.skip("needs the mkl wheel (pip install 'mlxcel[mkl]')")
    if item.get_closest_marker("requires_openblas") is None or blas_kind() == "openblas":
        return
    if os.environ.get("MLXCEL_REQUIRE_OPENBLAS") == "1":
        pytest.fail("MLXCEL_REQUIRE_OPENBLAS=1 but the system OpenBLAS was not loaded "
                    f"(BLAS: {load_fast_blas()}): install libopenblas0-pthread", pytrace=False)
    pytest.skip("needs the system OpenBLAS (libopenblas0-pthread; CI installs it)")


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def hints(cache_root: Path) -> HintStore:
    return HintStore(cache_root)


@pytest.fixture
def pairing() -> PairingKey:
    return PairingKey(target="Gemma4-12B", drafter="Gemma4-12B-MTP", hardware=APPLE_M5.label, block_size=4)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own cache root, so no test reads or writes ~/.cache."""
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "mlxcel-cache"))
    for name in ("MLXCEL_MTP_ADAPTIVE", "MLXCEL_ENABLE_MTP_B1", "MLXCEL_DRAFT_BLOCK_SIZE",
                 "MLXCEL_MTP_ALLOW_INEXACT", "MLXCEL_MTP_PROFILE_SAMPLES"):
        monkeypatch.delenv(name, raising=False)
