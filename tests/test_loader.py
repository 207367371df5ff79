"""Loading safetensors folders: sharded, converted dtypes, and clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams


def copy_folder_without_weights(source, target):
    for path in source.iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copy(path, target / path.name)


def test_sharded_bfloat16_checkpoint_loads_into_float32(llama_dir, tmp_path):
    copy_folder_without_weights(llama_dir, tmp_path)
    hf_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32")
    params = dict(llm.engine.runner.model.named_parameters())
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(params[name], tensor.float())


def test_unknown_and_misshapen_tensors_are_refused(llama_dir, tmp_path):
    copy_folder_without_weights(llama_dir, tmp_path)
    weights = load_file(llama_dir / "model.safetensors")
    save_file({**weights, "model.extra.weight": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.extra.weight' matches no parameter"):
        LLM(str(tmp_path))
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LLM(str(tmp_path))
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 parameters"):
        LLM(str(tmp_path))


def test_bfloat16_engine_generates(llama_dir):
    llm = LLM(str(llama_dir), dtype="bfloat16")
    output = llm.generate(["What is 2+3?"], SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 5
