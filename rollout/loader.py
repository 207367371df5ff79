"""Loading a Hugging Face folder's safetensors weights into a Tandem model, name for name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# Buffers some checkpoints carry that Tandem recomputes instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    """Copy every checkpoint tensor into the parameter of the same name.

    Raises:
        ValueError: on an unknown name, a shape mismatch, or a parameter the checkpoint lacks.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                _copy_into(params, name, f.get_tensor(name))
                loaded.add(name)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(params) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} parameters, e.g. "
                         f"{sorted(missing)[:5]}")


def _copy_into(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model.")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                         f"model expects {tuple(param.shape)}.")
    with torch.no_grad():
        param.copy_(tensor)
