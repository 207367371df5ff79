"""Builds Tandem's C kernels for the CPU (``cpu_attention.c``, ``cpu_layers.c``,
``cpu_linear.c``, ``cpu_threads.c``) into one shared library and loads it with ``ctypes``.

The sources are plain C with no torch headers, so they compile in about a second, on first
use, with the system's C compiler (``$CC``, else ``gcc`` or ``cc``) for this machine
(``-march=native``). The library is cached in the Tandem cache folder (``cache_dir``), keyed
by the sources, the flags, the compiler and the CPU. Its OpenMP runtime is the one torch
already loaded (same soname), so the kernels run on torch's threads. ``library()`` is None
where the build fails (no compiler): the engine then takes the torch references, which give
the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_attention.c", "cpu_layers.c", "cpu_linear.c", "cpu_threads.c"))
HEADERS = (Path(__file__).with_name("cpu_bf16.h"),)
# The attention kernel's stack arrays; larger shapes take the reference.
MAX_HEAD_DIM, MAX_GROUP = 256, 32
# The dtypes the kernels take, as their `bf16` flag.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC",
         f"-DMAX_HEAD_DIM={MAX_HEAD_DIM}", f"-DMAX_GROUP={MAX_GROUP}")
# Linked apart from the compile: gcc before 13 links crtfastmath.o into a library linked with
# -ffast-math, and loading it turns on flush-to-zero for the whole process (the trainer's
# float maths, numpy's, everyone's).
LINK_FLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    """Tandem's cache folder (converted models, kernels, timings): ``$TANDEM_CACHE`` or
    ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache  # the key of the library this process loads, read from disk once
def _key(compiler: str) -> str:
    """A digest of what the library's code depends on: sources, headers, flags, CPU."""
    parts = [path.read_bytes() for path in SOURCES + HEADERS]
    flags = " ".join(FLAGS + LINK_FLAGS).encode()
    return hashlib.sha256(b"\0".join([*parts, flags, compiler.encode(),
                                       cpu_name().encode()])).hexdigest()[:24]


def library_key() -> str | None:
    """The digest naming the library in use, None where it does not build: a timing of
    the kernels is only valid for the code it timed."""
    return _key(_compiler()) if available() else None


def _build(compiler: str) -> Path:
    """The shared library, compiled unless these sources, headers, flags and CPU have one."""
    library = cache_dir() / "kernels" / f"tandem_cpu-{_key(compiler)}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        staged = library.with_name(f"{library.name}.{os.getpid()}.tmp")
        with tempfile.TemporaryDirectory() as objects:
            subprocess.run([compiler, *FLAGS, "-c", *map(str, SOURCES)], cwd=objects,
                           check=True, capture_output=True, text=True, timeout=120)
            subprocess.run([compiler, *LINK_FLAGS, "-o", str(staged),
                            *sorted(Path(objects).glob("*.o")), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
        staged.replace(library)  # atomic: concurrent engines never load a partial file
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (with a warning) where it does not build."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("No C compiler ($CC, gcc, cc): the CPU kernels take the torch "
                       "references (slower); install gcc for the compiled kernels.")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        logger.warning("Compiling the CPU kernels failed (%s): they take the torch "
                       "references (slower).", detail)
        return None


def available() -> bool:
    """True when the compiled kernels build and load on this machine."""
    return library() is not None


@functools.cache
def kernel(name: str, argtypes: tuple, restype: type | None = None):
    """The library's function ``name`` with its ctypes signature (the library must be
    ``available``)."""
    function = getattr(library(), name)
    function.argtypes, function.restype = argtypes, restype
    return function
