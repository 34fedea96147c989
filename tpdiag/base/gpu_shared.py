"""Whether this process may hold a CUDA context on a GPU that a world's rank will use too."""
from __future__ import annotations

import ctypes
import ctypes.util

_COMPUTE_MODE = 20  # CU_DEVICE_ATTRIBUTE_COMPUTE_MODE; 0 is CU_COMPUTEMODE_DEFAULT


def shareable(ordinal: int = 0) -> bool:
    """True when visible GPU `ordinal` is in the default compute mode. Under exclusive-process
    (common on clusters) a context this process made would keep the rank placed on that GPU from
    making its own, and the world would fail: the caller then stays on the host. Asked of the
    driver without making a context (cuInit, cuDeviceGet, cuDeviceGetAttribute); any failure
    reads as not shareable."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        dev, mode = ctypes.c_int(), ctypes.c_int()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return False
        if lib.cuDeviceGetAttribute(ctypes.byref(mode), _COMPUTE_MODE, dev) != 0:
            return False
        return mode.value == 0
    except (OSError, AttributeError):
        return False
