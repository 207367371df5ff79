"""The ctypes structures passed to the CUDA driver have ``cuda.h``'s layout.

The reference numbers are what gcc gave for CUDA 13.0's ``cuda.h`` (``sizeof`` and
``offsetof`` of ``CUmemLocation``, ``CUmemAllocationProp`` and ``CUmemAccessDesc``); the
calls themselves need a GPU (``benchmarks/sleep_memory_probe.py``).
"""

from __future__ import annotations

import ctypes

from tandem.rollout.worker import cuda_driver as driver


def offsets(structure: type[ctypes.Structure]) -> dict[str, int]:
    return {name: getattr(structure, name).offset for name, _ in structure._fields_}


def test_structures_have_the_layout_of_cuda_h():
    assert ctypes.sizeof(driver.CUmemLocation) == 8
    assert offsets(driver.CUmemLocation) == {"type": 0, "id": 4}
    assert ctypes.sizeof(driver.CUmemAllocationProp) == 32
    assert offsets(driver.CUmemAllocationProp) == {
        "type": 0, "requestedHandleTypes": 4, "location": 8, "win32HandleMetaData": 16,
        "allocFlags": 24}
    flags = {name: 24 + offset for name, offset in offsets(driver.CUmemAllocationFlags).items()}
    assert flags == {"compressionType": 24, "gpuDirectRDMACapable": 25, "usage": 26,
                     "reserved": 28}
    assert ctypes.sizeof(driver.CUmemAccessDesc) == 12
    assert offsets(driver.CUmemAccessDesc) == {"location": 0, "flags": 8}


def test_constants_have_the_values_of_cuda_h():
    assert (driver.CU_MEM_ALLOCATION_TYPE_PINNED, driver.CU_MEM_LOCATION_TYPE_DEVICE,
            driver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            driver.CU_MEM_ALLOC_GRANULARITY_MINIMUM) == (1, 1, 3, 0)


def test_an_allocation_asks_for_pinned_unexported_uncompressed_device_memory():
    prop = driver._pinned_on(3)
    raw = bytes(prop)
    assert raw[:16] == bytes([1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0])
    assert raw[16:] == bytes(16)  # no win32 metadata, allocFlags all zero
