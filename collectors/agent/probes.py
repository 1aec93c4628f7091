"""What the agent can learn about its process without touching CUPTI: is there a driver, has
the target loaded CUDA, which versions are installed and do they fit the driver, is CUPTI
already someone else's, which libcupti is mapped. Each answer that says "no" says what to do.

Test seam: with `KDASH_AGENT_FAKE_CUDA=<cuda version int, e.g. 13000>` in the target's
environment the driver probe reports that version and CUDA counts as loaded. The tests use it
with a stand-in `cupti` module to drive the whole START -> records -> STOP path on a machine
without a GPU; it changes nothing else.
"""

from __future__ import annotations

import os
import sys

from .constants import ENV_FAKE_CUDA


def driver_cuda_version() -> tuple[int | None, str]:
    """The CUDA version the installed driver supports (e.g. 13000), or None and why not.

    Uses cuDriverGetVersion through ctypes: it needs no cuInit, creates no context, and works
    whether or not cuda-bindings is installed.
    """
    fake = os.environ.get(ENV_FAKE_CUDA)
    if fake:
        return int(fake), ""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"no NVIDIA driver here (libcuda.so.1 not loadable: {e})"
    v = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(v))
    if rc != 0:
        return None, f"cuDriverGetVersion failed with CUDA error {rc}"
    return v.value, ""


def driver_absent() -> str | None:
    """Why there is no NVIDIA driver here, or None; without loading libcuda (see cuda_loaded)."""
    if os.environ.get(ENV_FAKE_CUDA):
        return None
    marks = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg")  # dxg: WSL
    if any(os.path.exists(m) for m in marks):
        return None
    return "no NVIDIA driver here (no /dev/nvidiactl, no /proc/driver/nvidia)"


def cuda_loaded() -> bool:
    """Has this process loaded libcuda? Until it has, enabling CUPTI would pull CUDA into a
    process that may never use it, so the agent waits instead."""
    if os.environ.get(ENV_FAKE_CUDA):
        return True
    try:
        with open("/proc/self/maps", "rb") as f:
            return b"libcuda.so" in f.read()
    except OSError:
        return True  # no /proc: cannot tell, do not wait forever


def _vtuple(v: str) -> tuple[int, int]:
    parts = (v.split(".") + ["0", "0"])[:2]
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except ValueError:
        return 0, 0


def dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None
    except Exception:  # noqa: BLE001 - metadata of a broken install must not stop the agent
        return None


def install_hint(driver_cuda: int | None) -> str:
    """What to pip install in the target's environment for this driver."""
    if driver_cuda is None:
        return "pip install 'cupti-python~=13.0.0' (matching your driver's CUDA version)"
    major, minor = driver_cuda // 1000, (driver_cuda % 1000) // 10
    return (
        f"pip install 'cupti-python~={major}.{minor}.0' 'nvidia-cuda-cupti~={major}.{minor}.0' "
        f"in the target's Python (the driver supports CUDA {major}.{minor})"
    )


def version_mismatch(driver_cuda: int, cupti_python: str | None, cupti_lib: str | None) -> str:
    """A one-line warning when cupti-python or libcupti is newer than the driver's CUDA, else "".

    Older CUPTI runs on newer drivers; a newer one may be refused by an older driver (seen:
    cupti-python 13.4 wants nvidia-cuda-cupti 13.4, which driver 580 / CUDA 13.0 may refuse).
    """
    drv = (driver_cuda // 1000, (driver_cuda % 1000) // 10)
    for what, v in (("cupti-python", cupti_python), ("nvidia-cuda-cupti", cupti_lib)):
        if v and _vtuple(v) > drv:
            return (
                f"{what} {v} is newer than the driver's CUDA {drv[0]}.{drv[1]}; "
                f"{install_hint(driver_cuda)}"
            )
    return ""


def other_cupti_client() -> str | None:
    """Why CUPTI is already taken in this process, or None when nothing says so.

    CUPTI serves one client per process: registering our buffers while torch.profiler (Kineto)
    or an injected tool (Nsight Systems, via CUDA_INJECTION64_PATH) is collecting would steal
    their records, so the agent must stay out of the way instead.
    """
    inj = os.environ.get("CUDA_INJECTION64_PATH")
    if inj:
        return f"an injected CUDA tool holds CUPTI in this process (CUDA_INJECTION64_PATH={inj})"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            enabled = torch.autograd.profiler._is_profiler_enabled
        except AttributeError:
            enabled = False
        if not enabled:
            try:
                enabled = bool(torch._C._autograd._profiler_enabled())
            except Exception:  # noqa: BLE001 - older/newer torch: the flag above decides
                enabled = False
        if enabled:
            return "torch.profiler is running in this process and holds CUPTI"


def find_libcupti() -> tuple[str | None, str]:
    """The one libcupti mapped into this process (cupti-python loaded it), or None and why."""
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split(None, 5)[5].strip()
                for line in f
                if "libcupti.so" in line and len(line.split(None, 5)) == 6
            }
    except OSError as e:
        return None, f"cannot read /proc/self/maps ({e})"
    if len(paths) != 1:
        return None, f"{len(paths)} libcupti copies are mapped ({', '.join(sorted(paths))})"
    return paths.pop(), ""
