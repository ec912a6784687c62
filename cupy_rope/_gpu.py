"""The library's first GPU touch: say plainly when there is no NVIDIA GPU or driver.

On a machine without any NVIDIA driver the CUDA runtime reports ``cudaErrorInsufficientDriver`` ("CUDA driver
version is insufficient for CUDA runtime version"), which reads as "upgrade your driver". The driver is too old
only when its library (libcuda) loads and reports a CUDA version below the runtime's; without libcuda there is
no driver at all. :func:`gpu_problem` tells the cases apart; :func:`require_gpu` raises with its answer.
The answer is computed once per process (CUDA initialisation failures are sticky anyway), so calling
:func:`require_gpu` on every entry point costs a cache lookup after the first call.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys

_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
_NO_DEVICE = 100  # cudaErrorNoDevice


class GpuUnavailable(RuntimeError):
    """No usable NVIDIA GPU. In IPython/Jupyter it renders as its message alone (no traceback): the reader
    needs the reason, not the call stack."""

    def _render_traceback_(self):
        return [str(self)]


def cuda_version(v: int) -> str:
    """12090 -> "12.9" (the encoding of cudaRuntimeGetVersion and cuDriverGetVersion)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_version() -> int | None:
    """CUDA version the installed driver supports (cuDriverGetVersion, no cuInit needed), or None when the
    driver library cannot be loaded, i.e. no NVIDIA driver is installed."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    v = ctypes.c_int(0)
    return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None


def explain(status: int, error: str, *, runtime: int, driver: int | None, smi: bool, visible: str | None) -> str:
    """The plain message for a failed device query (a pure function of the facts, so it can be tested anywhere).

    status/error: the CUDA runtime's error code and text; runtime: the runtime's CUDA version; driver: see
    :func:`driver_version`; smi: whether nvidia-smi is on PATH; visible: $CUDA_VISIBLE_DEVICES or None.
    """
    need = "cupy_rope needs a machine with an NVIDIA GPU and its driver"
    if driver is None:
        absent = "the driver library (libcuda) does not load" + ("" if smi else " and nvidia-smi is absent")
        if status == _INSUFFICIENT_DRIVER:
            return (f"cupy_rope: no NVIDIA GPU/driver found (no NVIDIA driver is installed: {absent}). The CUDA "
                    f"runtime calls this 'driver version is insufficient', but there is no driver to upgrade: {need}.")
        return f"cupy_rope: no NVIDIA GPU/driver found ({absent}; the CUDA runtime reports {error}). {need}."
    if status == _INSUFFICIENT_DRIVER and driver < runtime:
        fix = "upgrade the driver"
        if driver // 1000 in (12, 13):  # a CuPy build for the driver's own major version runs on it
            fix += f", or install the extra for CUDA {driver // 1000}: pip install -e \".[cuda{driver // 1000}]\""
        return (f"cupy_rope: the NVIDIA driver is too old (it supports CUDA {cuda_version(driver)}, the installed "
                f"CUDA runtime is {cuda_version(runtime)}): {fix}.")
    if status == _NO_DEVICE:
        hidden = f"; CUDA_VISIBLE_DEVICES={visible!r} may hide them" if visible is not None else ""
        return (f"cupy_rope: no NVIDIA GPU/driver found (a driver for CUDA {cuda_version(driver)} is installed but "
                f"reports no GPU{hidden}). {need}.")
    return (f"cupy_rope: no usable NVIDIA GPU (a driver for CUDA {cuda_version(driver)} is installed, but the CUDA "
            f"runtime {cuda_version(runtime)} reports {error}; nvidia-smi shows what the driver sees).")


def _diagnose() -> str | None:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install (two CuPy packages, say)
        return (f"cupy_rope: CuPy does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                f"; install the extra that matches the driver's CUDA major version: pip install -e \".[cuda12]\" "
                f"or \".[cuda13]\".")
    rt = cupy.cuda.runtime
    try:
        n = rt.getDeviceCount()
    except rt.CUDARuntimeError as e:
        return explain(e.status, str(e).splitlines()[0], runtime=rt.runtimeGetVersion(), driver=driver_version(),
                       smi=shutil.which("nvidia-smi") is not None, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    except Exception as e:  # noqa: BLE001 - e.g. the CUDA runtime library itself does not load
        return f"cupy_rope: no usable NVIDIA GPU (CuPy cannot query the devices: {type(e).__name__}: {e})."
    if n == 0:
        return explain(_NO_DEVICE, "cudaErrorNoDevice", runtime=rt.runtimeGetVersion(), driver=driver_version(),
                       smi=shutil.which("nvidia-smi") is not None, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return None


@functools.lru_cache(maxsize=None)
def gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else a plain one-paragraph reason (computed once per process)."""
    return _diagnose()


def require_gpu() -> None:
    """Raise :class:`GpuUnavailable` (a RuntimeError) with :func:`gpu_problem`'s reason when there is no usable
    GPU; after the first call this is a cache lookup (about 0.1 µs)."""
    problem = gpu_problem()
    if problem is not None:
        raise GpuUnavailable(problem)
