"""Run a Python script with CUDA's blocking synchronisation: a thread that waits for the GPU sleeps
instead of spinning on a core.

    python benchmark/ocr_proxy/blocking_sync.py crd.py --model ...  # as `python crd.py ...`

CUDA's default spins while a thread waits, when the process has fewer contexts than the machine has
cores. Many trainers sharing one GPU each wait while the others' kernels run, and their spinning
takes cores that the PP-OCR reads need. This sets the flag of every GPU's primary context (the one
torch uses) through the driver before anything creates it, then runs the script as `python` would.
Without a CUDA driver it only runs the script.
"""

from __future__ import annotations

import ctypes
import runpy
import sys
from pathlib import Path

CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def set_blocking_sync() -> int:
    """Sets the flag on every visible GPU's primary context; the number of GPUs (0: no driver or
    GPU)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGetCount(ctypes.byref(count)):
        return 0
    set_flags = (getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None)
                 or driver.cuDevicePrimaryCtxSetFlags)
    for ordinal in range(count.value):
        device = ctypes.c_int()
        refused = (driver.cuDeviceGet(ctypes.byref(device), ordinal)
                   or set_flags(device, CU_CTX_SCHED_BLOCKING_SYNC))
        if refused:
            sys.exit(f"blocking_sync.py: error: the CUDA driver refused the flag of GPU {ordinal}")
    return count.value


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmark/ocr_proxy/blocking_sync.py SCRIPT [ARGS...]")
    script = Path(sys.argv[1]).resolve()
    if not script.is_file():
        sys.exit(f"blocking_sync.py: error: {sys.argv[1]}: no such script")
    set_blocking_sync()
    sys.argv = sys.argv[1:]
    sys.path[0] = str(script.parent)  # as `python SCRIPT` puts the script's directory first
    runpy.run_path(str(script), run_name="__main__")
