"""The CUDA driver's virtual memory management calls, through ctypes on ``libcuda.so.1``.

They map physical device memory at a chosen virtual address, so the memory can be handed
back and taken again while every pointer into it stays valid (vLLM's ``CuMemAllocator``
does the same in C++; here no compiled extension is needed). Structures, constants and
signatures follow CUDA 13.0's ``cuda.h`` (``CUmemLocation_st``, ``CUmemAllocationProp_st``,
``CUmemAccessDesc_st``; ``cuMemCreate`` and the others in its Virtual Memory Management
section); ``tests/test_cuda_driver.py`` pins the layouts that a C compiler gave for that
header. None of these functions is renamed to a ``_v2`` symbol by the header.
"""

from __future__ import annotations

import ctypes
import functools

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0

CUdeviceptr = ctypes.c_ulonglong
CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    """``CUmemLocation``: a location type (an enum, 4 bytes) and its id (a device ordinal)."""

    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class CUmemAllocationFlags(ctypes.Structure):
    """``CUmemAllocationProp.allocFlags`` (an anonymous struct in ``cuda.h``)."""

    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp``: what ``cuMemCreate`` allocates (32 bytes)."""

    _fields_ = [("type", ctypes.c_uint), ("requestedHandleTypes", ctypes.c_uint),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", CUmemAllocationFlags)]


class CUmemAccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: who may access a mapped range, and how (12 bytes)."""

    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_uint)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


_SIGNATURES = {
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t),
                                      ctypes.POINTER(CUmemAllocationProp), ctypes.c_uint],
    "cuMemAddressReserve": [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t,
                            CUdeviceptr, ctypes.c_ulonglong],
    "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
    "cuMemCreate": [ctypes.POINTER(CUmemGenericAllocationHandle), ctypes.c_size_t,
                    ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [CUmemGenericAllocationHandle],
    "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle,
                 ctypes.c_ulonglong],
    "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
    "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc),
                       ctypes.c_size_t],
}


@functools.cache
def _driver() -> ctypes.CDLL:
    library = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int  # CUresult
    return library


def _call(name: str, *args: object) -> None:
    result = getattr(_driver(), name)(*args)
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise CudaDriverError(f"{name} failed with CUresult {result}: {text}")


def ensure_context(ordinal: int) -> None:
    """Make the device's primary context current on this thread if none is (a server's
    worker thread may never have touched CUDA); torch's runtime already created it.

    Raises:
        CudaDriverError: when the driver refuses.
    """
    context = ctypes.c_void_p()
    _call("cuCtxGetCurrent", ctypes.byref(context))
    if context.value:
        return
    device = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(device), ordinal)
    _call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    _call("cuCtxSetCurrent", context)


def _device_location(ordinal: int) -> CUmemLocation:
    return CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)


def _pinned_on(ordinal: int) -> CUmemAllocationProp:
    """Device memory of ``ordinal``, not exportable (handle type 0), uncompressed."""
    return CUmemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                               location=_device_location(ordinal))


def granularity(ordinal: int) -> int:
    """The size (bytes) every mapping on the device must be a multiple of."""
    size = ctypes.c_size_t()
    _call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(_pinned_on(ordinal)),
          CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    return size.value


def reserve(num_bytes: int, alignment: int) -> int:
    """Reserve ``num_bytes`` of virtual addresses (no memory behind them); their start."""
    address = CUdeviceptr()
    _call("cuMemAddressReserve", ctypes.byref(address), num_bytes, alignment, 0, 0)
    return address.value


def map_new_memory(ordinal: int, address: int, num_bytes: int) -> int:
    """Create ``num_bytes`` of device memory, map it at ``address`` read-write for the
    device; returns its handle (for ``unmap_and_release``)."""
    handle = CUmemGenericAllocationHandle()
    _call("cuMemCreate", ctypes.byref(handle), num_bytes, ctypes.byref(_pinned_on(ordinal)), 0)
    access = CUmemAccessDesc(_device_location(ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    mapped = False
    try:
        _call("cuMemMap", address, num_bytes, 0, handle, 0)
        mapped = True
        _call("cuMemSetAccess", address, num_bytes, ctypes.byref(access), 1)
    except CudaDriverError:
        if mapped:
            _call("cuMemUnmap", address, num_bytes)
        _call("cuMemRelease", handle)
        raise
    return handle.value


def unmap_and_release(address: int, num_bytes: int, handle: int) -> None:
    """Unmap the range and free the memory behind it; the addresses stay reserved."""
    _call("cuMemUnmap", address, num_bytes)
    _call("cuMemRelease", handle)


def free_addresses(address: int, num_bytes: int) -> None:
    """Give a reserved range (nothing mapped in it) back to the driver."""
    _call("cuMemAddressFree", address, num_bytes)
