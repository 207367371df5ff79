"""The CPU linear layers' packed weights: equal to the plain matmul, never stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_linear
from tandem.kernels.cpu_linear import PackedWeight
from tandem.rollout import LLM
from tandem.rollout.models.llama import Linear

from .test_weight_update import completions, fresh_completions, trainer_model

pytestmark = pytest.mark.skipif(not cpu_linear.packs(torch.float32),
                                reason="this torch has no oneDNN")


def packed_modules(llm: LLM) -> list[Linear]:
    model = llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_plain_matmul(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=generator)
    b = torch.randn(48, generator=generator) if bias else None
    x = torch.randn(rows, 40, generator=generator)
    out = cpu_linear.linear(x, weight, b, PackedWeight())
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_in_place_writes_and_new_storage():
    weight, packed = torch.randn(32, 16), PackedWeight()
    x = torch.randn(8, 16)
    cpu_linear.linear(x, weight, None, packed)
    with torch.inference_mode():
        weight.copy_(torch.randn(32, 16))  # a weight update's in-place copy
        torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed),
                                   F.linear(x, weight))
    weight.data = torch.randn(32, 16)  # new storage
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed), F.linear(x, weight))


def test_engine_packs_its_weights_and_an_update_repacks_them(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    before = completions(llm)
    assert llm.engine.runner.model.lm_head.packed is None  # kept on F.linear for parity
    modules = [m for m in packed_modules(llm) if m.packed is not None]
    assert len(modules) == 7 * llm.engine.runner.model.config.num_hidden_layers
    assert all(m.packed.key is not None for m in modules)
    keys = [m.packed.key for m in modules]
    trainer = trainer_model(llama_dir, seed=3)
    llm.update_weights(trainer.state_dict().items())
    after = completions(llm)
    assert after != before
    assert all(m.packed.key != key for m, key in zip(modules, keys, strict=True))
    assert after == fresh_completions(trainer, llama_dir, tmp_path)


def test_alias_serves_unpacked_weights_that_change_in_place(llama_dir):
    llm, reference = LLM(str(llama_dir)), LLM(str(llama_dir))
    completions(llm)
    trainer = trainer_model(llama_dir, seed=4)
    llm.update_weights(trainer.state_dict().items(), alias=True)
    assert all(m.packed is None for m in packed_modules(llm))
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.1)  # no new commit: an aliased engine serves this as it is
    reference.update_weights(trainer.state_dict().items())
    assert completions(llm) == completions(reference)
