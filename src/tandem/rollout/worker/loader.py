"""Loading a Hugging Face folder's safetensors weights into a Tandem model, name for name.

Tensors are read straight from the file into the parameters' memory (``readinto``) when
dtype and device allow, so loading needs no second copy of the weights and maps no file
pages into the process (a memory-mapped read would count the whole file in peak RSS).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn

from ..parallel.tensor_parallel import TensorParallel, local_shape, local_slice

# Buffers some checkpoints carry that Tandem recomputes instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}


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


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the parameter of the same name (under tensor
    parallelism, this rank's slice of it: ``model.tp``).

    Raises:
        ValueError: on an unknown name, a shape mismatch, an unsupported dtype, or a
            parameter the checkpoint lacks.
    """
    params = dict(model.named_parameters())
    tp: TensorParallel = getattr(model, "tp", TensorParallel())
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with open(path, "rb") as file:
            for name, entry, data_start in _read_header(file):
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                param = _parameter(params, name, entry, model.config, tp)
                if tp.size == 1:
                    _read_into(file, data_start, entry, param)
                else:
                    with torch.no_grad():
                        param.copy_(local_slice(name, _read_tensor(file, data_start, entry),
                                                model.config, tp))
                loaded.add(name)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} parameters, e.g. "
                         f"{sorted(missing)[:5]}")


def _read_header(file: BinaryIO) -> list[tuple[str, dict, int]]:
    """``(name, entry, data_start)`` of every tensor in a safetensors file."""
    (header_size,) = struct.unpack("<Q", file.read(8))
    header = json.loads(file.read(header_size))
    header.pop("__metadata__", None)
    return [(name, entry, 8 + header_size) for name, entry in header.items()]


def _parameter(params: dict[str, nn.Parameter], name: str, entry: dict, config: object,
               tp: TensorParallel) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model.")
    param = params[name]
    if tuple(param.shape) != local_shape(name, tuple(entry["shape"]), config, tp):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(entry['shape'])}, the "
                         f"model expects {tuple(param.shape)}.")
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {entry['dtype']}; Tandem loads "
                         f"{', '.join(SAFETENSORS_DTYPES)}.")
    return param


def _read_into(file: BinaryIO, data_start: int, entry: dict, param: nn.Parameter) -> None:
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
                              dtype=SAFETENSORS_DTYPES[entry["dtype"]])
    return staged.view(entry["shape"])
