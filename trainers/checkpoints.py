"""A checkpoint's model part: the policy as a Hugging Face folder any engine or
``from_pretrained`` loads (or, under LoRA, the peft adapter), and the value head."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase


def save_policy(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor],
                tokenizer: PreTrainedTokenizerBase, lora: bool) -> None:
    """Write ``model`` (its full ``weights`` by the policy's names, ``model.``-prefixed, or
    its adapter when ``lora``) and any ``value_head.`` weights into ``path``."""
    if lora:
        model.save_pretrained(path)
    else:
        save_file({name.removeprefix("model."): tensor.contiguous()
                   for name, tensor in weights.items() if name.startswith("model.")},
                  path / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    value_head = {name.removeprefix("value_head."): tensor
                  for name, tensor in weights.items() if name.startswith("value_head.")}
    if value_head:
        save_file(value_head, path / "value_head.safetensors")
