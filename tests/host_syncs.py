"""Finds, on a CPU, the calls that would make the host wait for a CUDA device.

On CUDA a step is queued, not run: the host goes on preparing the next step while the
device computes, unless some call needs a value the device has not produced yet. Such a
call (``.item()``, ``.tolist()``, ``bincount``, a boolean mask, a blocking copy, indices
from a Python list) stalls the host until the device drains, and inside a CUDA graph
capture it raises. ``torch.cuda.set_sync_debug_mode("error")`` finds them on a GPU; this
finds them on any machine, so a test can keep the hot path free of them.

``HostSyncs`` watches a block under a torch function mode and a dispatch mode. It tells the
device's tensors from the host's the way the device would: the tensors it is given (the
weights, the KV pool), the results of factories told ``device=`` the engine's device, of
copies ``.to`` it, and of every operator that reads a device tensor, are device tensors;
everything else (lists turned into tensors, the persistent block tables) is host memory.
A copy to the device gives a new tensor, as on a GPU, so the host's tensor stays host
memory; so does a non-blocking copy to the host (a pinned buffer, read after its event).
It records, with the innermost frame outside torch that made it:

- the operators that read a device tensor's value on the host: ``_local_scalar_dense``
  (``.item()``, ``bool()``, ``int()``), ``.tolist()``, ``.numpy()``, ``bincount``,
  ``nonzero``, ``masked_select``, ``unique``, ``equal``, indexing with a boolean mask,
  ``repeat_interleave`` without ``output_size``;
- copies to the host (``.cpu()``, ``.to("cpu")`` without ``non_blocking``) and blocking
  copies to the device (``.to(device)`` without ``non_blocking``: from pageable memory a
  CUDA copy waits for the stream);
- tensors built from Python data on the device (``torch.tensor(list, device=...)``) and
  host tensors mixed into a device operator (a list of indices, a tensor never moved):
  each an implicit blocking copy.

Calls made inside Triton (its interpreter emulates the device on the host) are not
recorded.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
TORCH_DIR = str(Path(torch.__file__).parent)
TRITON_DIR = str(Path(triton.__file__).parent)

# Operators whose output size or value the host must read from the device.
READS_DEVICE = {
    aten._local_scalar_dense.default: "reads a value on the host (.item(), bool(), int())",
    aten.bincount.default: "bincount (reads the largest value)",
    aten.nonzero.default: "nonzero (reads the count)",
    aten.masked_select.default: "masked_select (reads the count)",
    aten.equal.default: "equal (reads the answer)",
    aten.unique_dim.default: "unique (reads the count)",
    aten._unique.default: "unique (reads the count)",
    aten._unique2.default: "unique (reads the count)",
    aten.unique_consecutive.default: "unique_consecutive (reads the count)",
}
FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand",
             "randn", "randint", "linspace", "eye", "empty_strided"}
FROM_DATA = {"tensor", "as_tensor"}
HOST_READS = {"tolist": ".tolist()", "numpy": ".numpy()", "cpu": ".cpu() (a copy to the host)"}


@dataclass(frozen=True, slots=True)
class HostSync:
    """One call that makes the host wait for the device: what it is, and where (the
    innermost frame outside torch: ``module.py:function``)."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


class HostSyncs:
    """Records the calls of a ``with`` block that would make the host wait for ``device``.

    Args:
        device_tensors: what lives on the device at the start: tensors, modules (their
            parameters, buffers and tensor attributes) or objects (their tensor and module
            attributes, see ``_tensors_of``).
        device: the engine's device (on a CPU run, ``cpu``: what stands for the GPU).
    """

    def __init__(self, device_tensors: Iterable[object],
                 device: torch.device) -> None:
        self.device = torch.device(device)
        self.syncs: list[HostSync] = []
        self._quiet = 0
        self._tainted: dict[int, weakref.ref] = {}
        for item in device_tensors:
            self.mark(_tensors_of(item))
        self._modes = (_FunctionMode(self), _DispatchMode(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)

    def sites(self) -> set[str]:
        """The functions (``module.py:function``) that made a recorded call."""
        return {sync.where for sync in self.syncs}

    def on_device(self, tensor: object) -> bool:
        """True for a device tensor (see the module)."""
        if not isinstance(tensor, torch.Tensor):
            return False
        ref = self._tainted.get(id(tensor))
        return ref is not None and ref() is tensor

    def mark(self, tensors: Iterable[object]) -> None:
        """Take ``tensors`` (other objects are ignored) as device tensors."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and not self.on_device(tensor):
                key = id(tensor)  # forgotten with the tensor: a later one may get its id
                self._tainted[key] = weakref.ref(tensor,
                                                 lambda _, k=key: self._tainted.pop(k, None))

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Record nothing inside (a call already recorded as one sync)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def record(self, what: str) -> None:
        """Record a synchronizing call made now (unless Triton makes it)."""
        if self._quiet:
            return
        where = _tandem_frame()
        if where is not None:
            self.syncs.append(HostSync(what, where))

    def is_engine_device(self, device: object) -> bool:
        """True when ``device`` (a device, a string or an index) names the engine's."""
        return device is not None and torch.device(device).type == self.device.type


class _FunctionMode(TorchFunctionMode):
    """The Python-level calls: host reads, copies and factories."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        syncs = self.syncs
        source = args[0] if args else None
        if name in HOST_READS and syncs.on_device(source):
            syncs.record(HOST_READS[name])
        if name == "to" and isinstance(source, torch.Tensor):
            return self._copy(func, source, args, kwargs)
        if name in ("__getitem__", "__setitem__") and syncs.on_device(source) \
                and _has_python_sequence(args[1]):
            syncs.record("indices from a Python list (a blocking copy to the device)")
            with syncs.quiet():  # its copy of the indices is this one sync
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if name in FACTORIES and syncs.is_engine_device(kwargs.get("device")):
            if name in FROM_DATA and not isinstance(args[0], torch.Tensor):
                syncs.record(f"torch.{name} from Python data on the device (a blocking copy)")
            syncs.mark([result])
        return result

    def _copy(self, func, source: torch.Tensor, args, kwargs) -> torch.Tensor:
        syncs = self.syncs
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        result = func(*args, **kwargs)
        if device is None:
            return result
        if syncs.on_device(source):
            if device.type != "cpu":
                return result
            if not non_blocking:
                syncs.record(".to('cpu') without non_blocking (a blocking copy to the host)")
            return result.clone() if result is source else result  # host memory, as pinned
        if not syncs.is_engine_device(device):
            return result
        if not non_blocking:
            syncs.record(".to(device) without non_blocking (a blocking copy to the device)")
        copy = result.clone() if result is source else result  # a new tensor, as on a GPU
        syncs.mark([copy])
        return copy


class _DispatchMode(TorchDispatchMode):
    """The operators: those that read the device, and device tensors flowing through."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = self.syncs
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [syncs.on_device(t) for t in inputs]
        result = func(*args, **kwargs)
        if not any(on_device):
            return result
        what = _reads_device(func, args, kwargs)
        if what is not None:
            syncs.record(what)
        elif any(not device and t.dim() > 0 for t, device in zip(inputs, on_device)):
            syncs.record(f"{func} reads a host tensor (a blocking copy to the device)")
        syncs.mark(t for t in tree_flatten(result)[0])
        return result


def _reads_device(func, args, kwargs) -> str | None:
    """What ``func`` reads on the host, or None when it queues without reading."""
    if func in READS_DEVICE:
        return READS_DEVICE[func]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size (reads the total)"
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return "indexing with a boolean mask (reads the count)"
    return None


def _has_python_sequence(index: object) -> bool:
    """True when an index holds a list (or a tuple of lists): Python data to copy over."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(part, list) for part in index)


def _tensors_of(item: object) -> list[torch.Tensor]:
    """The tensors ``item`` holds: itself; a module's parameters, buffers and tensor
    attributes; or another object's tensor attributes (alone or in a tuple or list) and
    modules, one level down (a runner's pool, weights and last samples, not the host
    tables of its other parts)."""
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, torch.nn.Module):
        tensors = [*item.parameters(), *item.buffers()]
        for module in item.modules():
            tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        return tensors
    tensors = []
    for value in vars(item).values():
        if isinstance(value, (tuple, list)):
            tensors += [v for v in value if isinstance(v, torch.Tensor)]
        elif isinstance(value, (torch.Tensor, torch.nn.Module)):
            tensors += _tensors_of(value)
    return tensors


def _tandem_frame() -> str | None:
    """``module.py:function`` of the innermost frame outside torch and this module, or None
    when the call comes from inside Triton (its interpreter stands for the device)."""
    skipped = (TORCH_DIR, __file__)
    where = None
    for summary in traceback.extract_stack(sys._getframe(2)):
        if TRITON_DIR in summary.filename:
            return None
        if not summary.filename.startswith(skipped):
            where = f"{Path(summary.filename).name}:{summary.name}"
    return where
