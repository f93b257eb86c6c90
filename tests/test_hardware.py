"""Hardware labels and GPU fields."""

from __future__ import annotations

import platform

import pytest

from mlxcel.hardware import apple_gpu_generation, detect_host, hardware_label


@pytest.mark.parametrize(("kwargs", "label"), [
    ({"backend": "metal", "device_name": "Apple M5", "gpu_cores": 16}, "M5-16c"),
    ({"backend": "metal", "device_name": "Apple M3 Ultra", "gpu_cores": 80}, "M3-80c"),
    ({"backend": "cuda", "architecture": "sm_90"}, "cuda-sm_90-Unknown-0c"),
    ({"backend": "cuda"}, "cuda-Unknown-0c"),
    ({"backend": "rocm", "architecture": "gfx1151"}, "rocm-gfx1151-Unknown-0c"),
    ({"backend": "cpu-openblas", "architecture": "x86_64"}, "cpu-openblas-x86_64-Unknown-0c"),
    ({"backend": "cpu-reference", "architecture": "aarch64"}, "cpu-reference-aarch64-Unknown-0c"),
])
def test_labels(kwargs: dict[str, object], label: str) -> None:
    backend = kwargs.pop("backend")
    assert hardware_label(backend, **kwargs) == label  # type: ignore[arg-type]


@pytest.mark.parametrize(("arch", "generation"), [
    ("applegpu_g15s", 15), ("applegpu_g17p", 17), ("applegpu_g13g", 13), ("x86_64", None), (None, None),
])
def test_apple_generation(arch: str | None, generation: int | None) -> None:
    assert apple_gpu_generation(arch) == generation


def test_this_host() -> None:
    host = detect_host()
    # CI and development machines are Linux CPU: no GPU fields, the label keyed by CPU architecture.
    if platform.system() == "Linux":
        from mlxcel.blas import blas_kind

        assert host.label == f"cpu-{blas_kind()}-{platform.machine()}-Unknown-0c"
        assert (host.gpu_vendor, host.gpu_device, host.gpu_architecture) == ("Unknown", None, None)
        assert host.static_mtp_gate is False
