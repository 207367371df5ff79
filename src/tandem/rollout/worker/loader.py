"""Loading a Hugging Face folder's safetensors weights into a Tandem model, through its weight
spec (``models/weight_spec.py``: each checkpoint tensor's parameter, split and slot).

Tensors are read straight from the file into the parameters' memory (``readinto``) when
dtype and device allow, so loading needs no second copy of the weights and maps no file
pages into the process (a memory-mapped read would count the whole file in peak RSS).
MXFP4 tensors (GPT-OSS's experts: ``<name>_blocks`` and ``<name>_scales``, uint8) are
dequantized to the model's dtype once both halves are read (``models/mxfp4.py``), then
loaded as the checkpoint's ``<name>``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ..parallel.tensor_parallel import local_shape, local_slice
from .models import CausalLM, WeightTarget, mxfp4

# Buffers some checkpoints carry that Tandem recomputes instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}
PACKED_DTYPES = {"U8": torch.uint8}  # MXFP4's blocks and scales


def safetensors_files(model_dir: Path) -> list[Path]:
    """The folder's weight files: the sharded index's files, or every ``*.safetensors``.

    Raises:
        ValueError: when the folder holds no safetensors weights.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weights; save the model with "
                         "save_pretrained(..., safe_serialization=True).")
    return files


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the part of the parameter the model's weight spec
    gives it (under tensor parallelism, this rank's slice of it: ``model.tp``); a tensor
    under another layout's name goes where the model's ``unalias`` maps it.

    Raises:
        ValueError: on an unknown name, a shape mismatch, an unsupported dtype, a tensor of
            the spec the checkpoint lacks, or half of an MXFP4 pair (blocks without scales,
            or scales without blocks) or a pair whose shapes do not match.
    """
    spec, params = model.weight_spec(), dict(model.named_parameters())
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[str] = set()
    halves: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 pairs, by tensor, until whole
    for path in safetensors_files(model_dir):
        with open(path, "rb") as file:
            for name, entry, data_start in _read_header(file):
                if name.endswith(IGNORED_SUFFIXES) or name in tied:
                    continue
                if mxfp4.packed_part(name) is not None:
                    _check_dtype(name, entry, PACKED_DTYPES)
                    loaded |= _take_half(model, spec, params, halves, name,
                                         _read_tensor(file, data_start, entry))
                    continue
                _check_dtype(name, entry, SAFETENSORS_DTYPES)
                if name not in spec:
                    loaded |= _load_tensor(model, spec, params, name,
                                           _read_tensor(file, data_start, entry))
                    continue
                destination = _destination(spec, name, tuple(entry["shape"]), params, model)
                if model.tp.size == 1 and destination.is_contiguous():
                    _read_into(file, data_start, entry, destination)
                else:
                    _copy_into(destination, spec[name].split,
                               _read_tensor(file, data_start, entry), model)
                loaded.add(name)
    for name, pair in halves.items():
        (have,), (lacks,) = pair, set(mxfp4.SUFFIXES) - set(pair)
        raise ValueError(f"checkpoint in {model_dir} has {name}{have} without {name}{lacks}: "
                         "an MXFP4 tensor needs both; re-export the checkpoint.")
    missing = set(spec) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} parameters, e.g. "
                         f"{sorted(missing)[:5]}")


def _read_header(file: BinaryIO) -> list[tuple[str, dict, int]]:
    """``(name, entry, data_start)`` of every tensor in a safetensors file."""
    (header_size,) = struct.unpack("<Q", file.read(8))
    header = json.loads(file.read(header_size))
    header.pop("__metadata__", None)
    return [(name, entry, 8 + header_size) for name, entry in header.items()]


def _check_dtype(name: str, entry: dict, dtypes: dict[str, torch.dtype]) -> None:
    if entry["dtype"] not in dtypes:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {entry['dtype']}; Tandem loads "
                         f"{', '.join(dtypes)} for it.")


def _take_half(model: CausalLM, spec: dict[str, WeightTarget], params: dict[str, torch.Tensor],
               halves: dict[str, dict[str, torch.Tensor]], name: str, tensor: torch.Tensor
               ) -> set[str]:
    """Keep ``tensor``, one half of an MXFP4 pair, in ``halves`` until the other comes; then
    load the pair's tensor, dequantized to the model's dtype. Returns the spec's names
    loaded (none until the pair is whole)."""
    stem, suffix = mxfp4.packed_part(name)
    pair = halves.setdefault(stem, {})
    pair[suffix] = tensor
    if len(pair) < len(mxfp4.SUFFIXES):
        return set()
    del halves[stem]
    full = mxfp4.dequantize(stem, pair["_blocks"], pair["_scales"], model.lm_head.weight.dtype)
    return _load_tensor(model, spec, params, stem, full)


def _load_tensor(model: CausalLM, spec: dict[str, WeightTarget],
                 params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> set[str]:
    """Copy the full ``tensor`` named ``name`` (the spec's, or another layout's that the
    model's ``unalias`` maps) into its parameters' parts on this rank. Returns the spec's
    names it filled."""
    pairs = [(name, tensor)] if name in spec else _unalias(model, name, tensor)
    for alias, part in pairs:
        _copy_into(_destination(spec, alias, tuple(part.shape), params, model),
                   spec[alias].split, part, model)
    return {alias for alias, _ in pairs}


def _unalias(model: CausalLM, name: str, tensor: torch.Tensor
             ) -> list[tuple[str, torch.Tensor]]:
    pairs = model.unalias(name, tensor)
    if pairs is None:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model.")
    return pairs


def _destination(spec: dict[str, WeightTarget], name: str, shape: tuple[int, ...],
                 params: dict[str, torch.Tensor], model: CausalLM) -> torch.Tensor:
    """The part of a parameter the full tensor ``name`` (of ``shape``) fills on this rank.

    Raises:
        ValueError: when the shape does not fit it.
    """
    target = spec[name]
    destination = target.view(params[target.parameter])
    if tuple(destination.shape) != local_shape(target.split, shape, model.config, model.tp):
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, the model expects "
                         f"{tuple(destination.shape)}.")
    return destination


def _copy_into(destination: torch.Tensor, split: str | None, tensor: torch.Tensor,
               model: CausalLM) -> None:
    """Copy this rank's slice of the full ``tensor`` (of ``split``) into ``destination``."""
    with torch.no_grad():
        destination.copy_(local_slice(split, tensor, model.config, model.tp))


def _read_into(file: BinaryIO, data_start: int, entry: dict, param: torch.Tensor) -> None:
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    with torch.no_grad():
        if dtype == param.dtype and param.device.type == "cpu" and param.is_contiguous():
            file.seek(data_start + entry["data_offsets"][0])
            file.readinto(param.data.view(-1).view(torch.uint8).numpy())
        else:
            param.copy_(_read_tensor(file, data_start, entry))


def _read_tensor(file: BinaryIO, data_start: int, entry: dict) -> torch.Tensor:
    """The whole tensor, read into new memory."""
    begin, end = entry["data_offsets"]
    file.seek(data_start + begin)
    staged = torch.frombuffer(bytearray(file.read(end - begin)),
                              dtype={**SAFETENSORS_DTYPES, **PACKED_DTYPES}[entry["dtype"]])
    return staged.view(entry["shape"])
