"""Pinning a thread's OpenMP team to CPUs, one thread each (``cpu_threads.c``), and the CPU
lists that name them (``"0-1,4"``, as ``taskset`` and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
write them); releasing the team of a thread that should not compute.

Pinned threads keep their cores when other processes want them too: an unpinned team of
two on two cores, sharing them with a load generator, ran prefills about a third slower,
each parallel region waiting for whichever thread the scheduler had put aside.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import torch

from .cpu_build import available, kernel

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a list such as ``"0-3,8"``, in the order given.

    Raises:
        ValueError: for anything but comma-separated CPU numbers and ascending ranges, or a
            CPU named twice.
    """
    cpus: list[int] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a CPU list: write CPU numbers and ranges "
                             "separated by commas, such as '0-3' or '0,2,4'.")
        start, end = int(match[1]), int(match[2] or match[1])
        if end < start:
            raise ValueError(f"the range {part.strip()!r} in {text!r} runs backwards: write "
                             f"'{end}-{start}'.")
        cpus.extend(range(start, end + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"the CPU list {text!r} names a CPU twice: name each once.")
    return cpus


def cpus_to_bind(setting: str, num_threads: int) -> list[int] | None:
    """The CPUs to pin ``num_threads`` threads to under ``setting``: ``"none"`` (None),
    ``"auto"`` or a CPU list.

    ``"auto"`` pins them to the CPUs this process may use when there are exactly as many,
    or to one CPU of each physical core when there are as many cores (torch's default
    thread count on a machine with hyperthreads), and to none otherwise: a process given
    fewer threads (a tensor-parallel rank, a ``torch.set_num_threads`` of the user's)
    shares its CPUs with something that pinning would crowd out. Without the compiled
    kernels (no C compiler) ``"auto"`` pins none.

    Raises:
        ValueError: for a list that is not a CPU list, or not of ``num_threads`` CPUs.
    """
    if setting == "none":
        return None
    if setting == "auto":
        if not available():
            return None
        allowed = sorted(os.sched_getaffinity(0))
        first_of_each_core = sorted({_core(cpu): cpu for cpu in reversed(allowed)}.values())
        return next((cpus for cpus in (allowed, first_of_each_core)
                     if len(cpus) == num_threads), None)
    cpus = parse_cpu_list(setting)
    if len(cpus) != num_threads:
        raise ValueError(f"the CPU list {setting!r} names {len(cpus)} CPUs for {num_threads} "
                         "threads (torch.get_num_threads()): name one per thread, or set "
                         "OMP_NUM_THREADS to the list's length.")
    return cpus


def bind_threads(cpus: list[int]) -> None:
    """Pin the calling thread and the OpenMP team it runs torch's operations on to
    ``cpus``, one thread each (the caller to the first); threads it starts later inherit
    its CPU.

    Raises:
        ValueError: for a CPU this process may not use, or no compiled kernels to pin with.
        RuntimeError: when a thread could not be pinned.
    """
    outside = sorted(set(cpus) - os.sched_getaffinity(0))
    if outside:
        raise ValueError(f"CPUs {outside} are not among those this process may use "
                         f"({_cpu_list(os.sched_getaffinity(0))}): name others.")
    if not available():
        raise ValueError("pinning threads needs the compiled CPU kernels (a C compiler, "
                         "gcc or $CC): install one, or leave the threads unpinned.")
    bind = kernel("bind_threads", (ctypes.POINTER(ctypes.c_int), ctypes.c_int), ctypes.c_int)
    if bind((ctypes.c_int * len(cpus))(*cpus), len(cpus)):
        raise RuntimeError(f"the OpenMP threads could not all be pinned to CPUs "
                           f"{_cpu_list(cpus)}.")


def release_team() -> bool:
    """Make the calling thread run its OpenMP regions, torch's included, on itself alone,
    and end its team's other threads. False where that could not be done (no compiled
    kernels, or an OpenMP runtime older than 5.0).

    For a thread that should not compute beside the engine's (a server's event loop, which
    loaded the model): while a process's OpenMP teams hold more threads than it has CPUs,
    libgomp (torch's OpenMP) lets an idle thread spin only 100 times, not 300,000, before
    it sleeps, so every parallel region of the engine's team waits for its threads to wake.
    An idle second team made each decode step of the embedded model 30-80% slower on two
    cores.
    """
    if not available():
        return False
    torch.get_num_threads()  # torch sets a thread's count at its first call there: first
    return kernel("release_team", (), ctypes.c_int)() == 0


def _core(cpu: int) -> tuple[str, str] | int:
    """The physical core of ``cpu`` (its package and core ids; the CPU itself where Linux
    does not say)."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return ((topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip())
    except OSError:
        return cpu


def _cpu_list(cpus: set[int] | list[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
