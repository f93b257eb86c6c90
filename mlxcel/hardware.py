"""The serving host as the policy sees it: a coarse hardware label and the GPU fields.

The label keys persisted verdicts, so it must change whenever the answer to
"does MTP pay off here" could: Apple hosts by GPU generation and core count,
other hosts by backend and the architecture the backend publishes. This module
imports mlx; the policy never does.
"""

from __future__ import annotations

import platform
import re
import subprocess

from .policy import HostInfo

# Apple GPU generation from which the static per-hardware gate defaults the B=1
# burst on (the upstream system's static gate; M3-class and newer).
APPLE_STATIC_GATE_GENERATION = 15


def apple_gpu_generation(architecture: str | None) -> int | None:
    """15 for ``applegpu_g15s``; None when the string names no generation."""
    match = re.search(r"g(\d+)", architecture or "")
    return int(match.group(1)) if match else None


def hardware_label(backend: str, *, device_name: str | None = None,
                   architecture: str | None = None, gpu_cores: int = 0) -> str:
    """The hardware label for a host.

    Apple (``backend="metal"``): ``<chip generation>-<gpu cores>c``, e.g.
    ``M5-16c``. Others: the backend, then the architecture when the backend
    publishes one, then ``Unknown-0c``: ``cuda-sm_90-Unknown-0c``,
    ``cpu-openblas-x86_64-Unknown-0c`` (the CPU "backend" names its BLAS).
    """
    if backend == "metal":
        chip = re.search(r"\b(M\d+)\b", device_name or "")
        return f"{chip.group(1) if chip else 'Apple'}-{gpu_cores}c"
    return "-".join([backend, *([architecture] if architecture else []), "Unknown-0c"])


def _apple_gpu_cores() -> int:
    """The GPU core count from the IORegistry, or 0 when it cannot be read."""
    try:
        out = subprocess.run(["ioreg", "-rc", "AGXAccelerator", "-d1"], capture_output=True,
                             text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.search(r'"gpu-core-count"\s*=\s*(\d+)', out)
    return int(match.group(1)) if match else 0


def _vendor(device_name: str | None) -> str:
    name = (device_name or "").lower()
    if "nvidia" in name:
        return "Nvidia"
    if "amd" in name or "radeon" in name:
        return "Amd"
    return "Unknown"


def detect_host() -> HostInfo:
    """Read the active MLX backend. Must run on the thread that owns MLX."""
    import mlx.core as mx

    info = mx.device_info()
    device_name = str(info.get("device_name") or "") or None
    architecture = str(info.get("architecture") or "") or None
    if mx.metal.is_available():
        generation = apple_gpu_generation(architecture)
        return HostInfo(
            label=hardware_label("metal", device_name=device_name, gpu_cores=_apple_gpu_cores()),
            gpu_vendor="Apple", gpu_device=device_name, gpu_architecture=architecture,
            static_mtp_gate=generation is not None and generation >= APPLE_STATIC_GATE_GENERATION,
        )
    if mx.cuda.is_available():
        return HostInfo(
            label=hardware_label("cuda", architecture=architecture),
            gpu_vendor="Nvidia" if _vendor(device_name) == "Unknown" else _vendor(device_name),
            gpu_device=device_name, gpu_architecture=architecture, static_mtp_gate=False,
        )
    # The CPU backend: there is no GPU to report. The label tells CPU
    # architectures and BLAS libraries apart, since a verdict measured with one
    # says nothing about another (OpenBLAS is what makes the verify cheap).
    from .blas import blas_kind

    return HostInfo(
        label=hardware_label(f"cpu-{blas_kind()}", architecture=architecture or platform.machine() or None),
        gpu_vendor="Unknown", gpu_device=None, gpu_architecture=None, static_mtp_gate=False,
    )


#: The libraries whose kernels a measured verdict depends on.
_KERNEL_LIBRARIES = ("mlx", "mlx-lm")


def kernel_versions() -> dict[str, str]:
    """The installed versions of the libraries a verdict measured (``mlx``, ``mlx-lm``).

    A verify's cost changes between their releases (quantized products of a
    few rows, the attention kernels), so the persisted hint records them and a
    hint measured under others is profiled again.
    """
    import importlib.metadata

    versions = {}
    for name in _KERNEL_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def default_memory_budget() -> tuple[int, str]:
    """What this machine can hold safely, and how that was found: on Apple silicon nine tenths of the GPU's
    recommended working set (wired memory beyond it is not paged: past it, the kernel panics), on a CUDA device
    nine tenths of its memory, elsewhere three quarters of physical memory."""
    import os

    import mlx.core as mx

    info = mx.device_info()
    for key, what in (("max_recommended_working_set_size", "the GPU's recommended working set"),
                      ("memory_size", "the device's memory")):
        size = info.get(key)
        if (mx.metal.is_available() or mx.cuda.is_available()) and isinstance(size, int) and size > 0:
            return size * 9 // 10, f"nine tenths of {what} ({size / 1e9:.1f} GB)"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return physical * 3 // 4, f"three quarters of physical memory ({physical / 1e9:.1f} GB)"
