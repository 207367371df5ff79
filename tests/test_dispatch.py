"""Backend selection, and the whole Triton path end to end against the torch path.

On a CPU the Triton kernels run in Triton's interpreter (conftest switches it on).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import CPU_OPS, TORCH_OPS, cpu_build, select_kernels
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.config import EngineConfig

SHARED = list(range(40, 75))  # two full blocks and more: a prefix-cache hit for the second


def test_auto_is_the_compiled_kernel_on_cpu_and_forced_backends_are_honoured():
    assert cpu_build.available()  # the machines that run these tests have gcc
    assert select_kernels("auto", torch.device("cpu")) is CPU_OPS
    assert select_kernels("torch", torch.device("cpu")) is TORCH_OPS
    assert select_kernels("torch", torch.device("cuda")) is TORCH_OPS
    triton = select_kernels("triton", torch.device("cpu"))
    assert (triton.attention.name, triton.layers.name) == ("triton", "triton")


def test_each_backend_declares_what_the_runner_asks_of_it():
    triton = select_kernels("triton", torch.device("cpu"))
    assert triton.attention.captures_graphs and not triton.layers.cpu_linear_layouts
    assert triton.layers.batch_invariant_linear is not None
    assert not CPU_OPS.attention.captures_graphs and CPU_OPS.layers.cpu_linear_layouts
    assert TORCH_OPS.attention.cascade and not TORCH_OPS.attention.shards
    assert CPU_OPS.rms_norm is CPU_OPS.layers.rms_norm  # one lookup from a layer


def test_auto_is_torch_on_cpu_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu_build, "available", lambda: False)
    assert select_kernels("auto", torch.device("cpu")) is TORCH_OPS
    with pytest.raises(ValueError, match="C compiler.*attention_backend='torch'"):
        select_kernels("cpu", torch.device("cpu"))


def test_cpu_backend_off_the_cpu_is_refused():
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU, not cuda"):
        select_kernels("cpu", torch.device("cuda"))


def test_unknown_backend_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError,
                       match="attention_backend='cuda'.*'auto', 'triton', 'cpu', 'torch'"):
        EngineConfig(model="x", attention_backend="cuda")
    with pytest.raises(ValueError, match="'auto', 'triton', 'cpu', 'torch'"):
        select_kernels("flash", torch.device("cpu"))


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_kernels("triton", torch.device("cpu"))


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_backend_greedy_output_equals_torch_backend(model_dir, backend):
    # Qwen3 (q/k norms), chunked prefill (16-token budget), a prefix-cache hit and a forked
    # group: every kernel path of a step runs.
    prompts = [SHARED + [5, 9], [7, 3], SHARED + [11]]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
              SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)]
    outputs = {}
    for name in ("torch", backend):
        llm = LLM(str(model_dir("qwen3")), attention_backend=name, num_kv_blocks=32,
                  max_num_batched_tokens=16)
        outputs[name] = [c for o in llm.generate(prompts, params, use_tqdm=False)
                         for c in o.outputs]
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
    for ours, reference in zip(outputs[backend], outputs["torch"]):
        assert ours.token_ids == reference.token_ids
        assert ours.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
