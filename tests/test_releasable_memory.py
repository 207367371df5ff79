"""Releasable memory on CPU: released pages read zero at the same address, go back to the
system (the process's resident memory drops), and typed views cut the right bytes."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker import model_runner
from tandem.rollout.worker.cuda_driver import CudaDriverError
from tandem.rollout.worker.releasable_memory import ReleasableMemory

CPU = torch.device("cpu")
PAGE = mmap.PAGESIZE


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


@pytest.mark.parametrize("num_bytes", [1, PAGE, PAGE + 1, 3 * PAGE + 5])
def test_released_pages_read_zero_at_the_same_address_after_restore(num_bytes):
    memory = ReleasableMemory(num_bytes, CPU)
    assert not memory.tensor.count_nonzero()  # made zero
    address = memory.tensor.data_ptr()
    generator = torch.Generator().manual_seed(num_bytes)
    written = torch.randint(1, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    memory.tensor.copy_(written)
    memory.restore()  # not released: keeps what was written
    assert torch.equal(memory.tensor, written)
    memory.release()
    memory.release()
    assert memory.released
    memory.restore()
    assert not memory.released and memory.tensor.data_ptr() == address
    assert not memory.tensor.count_nonzero()
    memory.tensor.copy_(written)  # and it takes writes again
    assert torch.equal(memory.tensor, written)


def test_release_hands_the_written_pages_back_to_the_system():
    num_bytes = 64 << 20
    memory = ReleasableMemory(num_bytes, CPU)
    untouched = resident_bytes()
    memory.tensor.fill_(7)
    written = resident_bytes()
    memory.release()
    released = resident_bytes()
    assert written - untouched > 0.9 * num_bytes  # resident only once written
    assert written - released > 0.9 * num_bytes


def test_typed_views_cut_the_bytes_at_their_offsets():
    memory = ReleasableMemory(1024, CPU)
    values = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    memory.view(256, (2, 3), torch.float32).copy_(values)
    memory.view(512, (4,), torch.bfloat16).fill_(1.5)
    raw = memory.tensor.numpy()
    np.testing.assert_array_equal(raw[256:280].view(np.float32).reshape(2, 3), values.numpy())
    assert raw[512:520].view(np.uint16).tolist() == [0x3FC0] * 4  # bfloat16 1.5
    assert not raw[:256].any() and not raw[280:512].any() and not raw[520:].any()


def test_an_engine_without_fixed_addresses_falls_back_to_plain_memory(llama_dir, monkeypatch,
                                                                       caplog):
    def refuse(num_bytes, device):
        raise CudaDriverError("cuMemCreate failed with CUresult 801: operation not supported")

    monkeypatch.setattr(model_runner, "ReleasableMemory", refuse)
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    assert llm.engine.runner.kv_region is None
    assert "no memory at fixed addresses" in caplog.text
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6) for i in range(3)]
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.sleep(1)
    assert llm.engine.runner.kv_cache_bytes() == 0
    llm.wake_up()
    assert not llm.engine.runner.kv_cache.count_nonzero()  # a fresh pool, zeroed
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
