"""The decode hot path never makes the host wait for the device.

``host_syncs.HostSyncs`` finds, on a CPU, every call that would synchronize a CUDA stream
with the host. The first tests pin what it finds and what it lets through; the others run
steady-state overlapped decode steps of engines on the Triton kernels (CUDA's code path,
under Triton's interpreter here) with each launch under it: a dense model, a mixture of
experts (the fused Triton path), an FP8 KV cache, int8 weights, routing replay,
``min_tokens``, penalties, top-k/top-p/min-p, top log-probs, seeded and unseeded sampling,
attention sinks with a logit soft cap, and grammars (whose steps land at once, but whose
launch queues the mask's copy). What must read the device is allowed its one read, named
here: prompt log-probs (``Sampler.prompt_logprobs`` reads its rows), and the exact
per-expert loop of a mixture of experts (its counts), which is why such a model is not
captured in CUDA graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tandem.rollout import LLM, SamplingParams

from .host_syncs import HostSyncs
from .test_moe import save_moe

CPU = torch.device("cpu")


def syncs_of(fn, *device_tensors) -> list[str]:
    with HostSyncs(device_tensors, CPU) as syncs:
        fn()
    return [sync.what for sync in syncs.syncs]


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("call, found", [
    (lambda w: w.sum().item(), "reads a value on the host"),
    (lambda w: (w @ w[0]).tolist(), ".tolist()"),
    (lambda w: w.numpy(), ".numpy()"),
    (lambda w: bool(w[0, 0] > 0), "reads a value on the host"),
    (lambda w: torch.bincount(w.argmax(1), minlength=4), "bincount"),
    (lambda w: w.nonzero(), "nonzero"),
    (lambda w: torch.where(w > 0), "nonzero"),
    (lambda w: w[w > 0], "boolean mask"),
    (lambda w: w.masked_select(w > 0), "masked_select"),
    (lambda w: w.argmax(1).unique(), "unique"),
    (lambda w: w.repeat_interleave(w.argmax(1) + 1, dim=0), "without output_size"),
    (lambda w: w.cpu(), ".cpu()"),
    (lambda w: w.to("cpu"), "blocking copy to the host"),
    (lambda w: w[[0, 2]], "indices from a Python list"),
    (lambda w: w.__setitem__(([0, 1], [2, 3]), 0.0), "indices from a Python list"),
    (lambda w: w[torch.tensor([0, 2])], "reads a host tensor"),
    (lambda w: w + torch.tensor([1.0, 2.0, 3.0, 4.0], device=CPU), "from Python data"),
    (lambda w: w[0] + torch.ones(4), "reads a host tensor"),
    (lambda w: w + torch.ones(4).to(CPU), "blocking copy to the device"),
])
def test_each_synchronizing_call_is_found(weight, call, found):
    found_syncs = syncs_of(lambda: call(weight), weight)
    assert found_syncs and any(found in what for what in found_syncs), found_syncs


def test_device_work_and_host_work_pass(weight):
    def step():
        host = torch.tensor([2, 0, 1])  # host work: lists, reads, repeat_interleave
        host.tolist()
        torch.repeat_interleave(host, host).sum().item()
        rows = host.to(CPU, non_blocking=True)  # a pinned copy's path
        counts = torch.zeros(4, device=CPU).scatter_add_(0, weight.argmax(1),
                                                         torch.ones(5, device=CPU))
        picked = weight[rows] * counts[:3, None] + torch.tensor(2.0)  # a 0-dim scalar
        picked.repeat_interleave(rows + 1, dim=0, output_size=6)
        picked.to("cpu", non_blocking=True)
        assert host.tolist() == [2, 0, 1]  # the device copy left the host's tensor alone

    assert syncs_of(step, weight) == []


def test_a_sync_names_the_frame_that_made_it(weight):
    def reads_on_the_host():
        return weight.sum().item()

    with HostSyncs([weight], CPU) as syncs:
        reads_on_the_host()
    assert syncs.sites() == {"test_host_syncs.py:reads_on_the_host"}


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return save_moe("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_syncs"))


PROMPTS = [[1, 5, 9, 2, 7], [1, 30, 31, 32, 33, 34, 35, 36], [1, 12, 40]]
BASE = dict(max_tokens=10, ignore_eos=True, seed=3, temperature=1.0)
CASES = {
    "dense greedy": ("llama", {}, dict(temperature=0.0)),
    "dense seeded": ("llama", {}, {}),
    "dense unseeded n=2": ("llama", {}, dict(seed=None, n=2)),
    "top-k, top-p, min-p": ("llama", {}, dict(top_k=20, top_p=0.9, min_p=0.05)),
    "min_tokens": ("llama", {}, dict(min_tokens=8, ignore_eos=False, stop_token_ids=[4, 5])),
    "penalties": ("llama", {}, dict(repetition_penalty=1.2, presence_penalty=0.5,
                                    frequency_penalty=0.3)),
    "top log-probs": ("llama", {}, dict(logprobs=3)),
    "fp8 kv": ("llama", dict(kv_cache_dtype="fp8"), {}),
    "int8 weights": ("llama", dict(quantization="int8"), {}),
    "moe": ("moe", {}, {}),
    "moe routing replay": ("moe", {}, dict(return_routed_experts=True)),
}


def engine_on_triton(folder, **engine_args) -> LLM:
    return LLM(str(folder), attention_backend="triton", async_scheduling=True, num_kv_blocks=64,
               max_num_seqs=8, max_model_len=128, **engine_args)


@contextlib.contextmanager
def watched_launches(llm: LLM, decodes_only: bool = True) -> Iterator[HostSyncs]:
    """Every launch of ``llm``'s runner inside the block under one watcher (each a decode
    step when ``decodes_only``)."""
    runner = llm.engine.runner
    syncs = HostSyncs([runner], runner.device)
    launch = runner.launch

    def watched_launch(batch, after_unread=False):
        assert not decodes_only or batch.num_decodes == len(batch.seqs), "not all decodes"
        with syncs:
            return launch(batch, after_unread)

    runner.launch = watched_launch
    try:
        yield syncs
    finally:
        runner.launch = launch


def decode_syncs(llm: LLM, params: SamplingParams) -> HostSyncs:
    """What four steady-state decode launches of ``llm`` record (after the prefill, the
    fork and the first decode); the requests then run to their end."""
    engine = llm.engine
    engine.add_requests([str(i) for i in range(len(PROMPTS))], PROMPTS, [params] * len(PROMPTS))
    for _ in range(3):
        engine.step()
    with watched_launches(llm) as syncs:
        for _ in range(4):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return syncs


@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_state_decode_step_never_waits_for_the_device(case, llama_dir, qwen3_moe_dir):
    kind, engine_args, overrides = CASES[case]
    llm = engine_on_triton(llama_dir if kind == "llama" else qwen3_moe_dir, **engine_args)
    syncs = decode_syncs(llm, SamplingParams(**(BASE | overrides)))
    assert [str(sync) for sync in syncs.syncs] == []


def test_a_decode_step_with_sinks_and_a_softcap_never_waits_for_the_device(llama_dir):
    """A layer's attention sinks (a parameter, as GPT-OSS's) and logit soft cap (a float,
    as Gemma 2's) reach the Triton kernels without a read."""
    llm = engine_on_triton(llama_dir)
    for layer in llm.engine.runner.model.attention_layers():
        layer.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, layer.num_heads))
        layer.logit_softcap = 30.0
    syncs = decode_syncs(llm, SamplingParams(**BASE))
    assert [str(sync) for sync in syncs.syncs] == []


def test_the_exact_per_expert_loop_reads_its_counts_so_it_is_not_captured(qwen3_moe_dir):
    """Exact log-probs run each expert through the batch-invariant matmul, slicing its rows
    by a count read on the host: such experts say they cannot be captured."""
    assert all(layer.capturable for layer in engine_on_triton(qwen3_moe_dir).engine.runner
               .moe_layers)
    exact = engine_on_triton(qwen3_moe_dir, exact_logprobs=True)
    assert not any(layer.capturable for layer in exact.engine.runner.moe_layers)
    syncs = decode_syncs(exact, SamplingParams(**BASE))
    assert syncs.sites() == {"moe.py:_grouped"}


def test_prompt_log_probs_are_the_one_read_and_it_is_named(llama_dir):
    """A chunk that scores its prompt lands at once: its one read is the scores'."""
    llm = engine_on_triton(llama_dir)
    with watched_launches(llm, decodes_only=False) as syncs:
        llm.generate(PROMPTS, SamplingParams(max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    assert syncs.sites() == {"sampler.py:prompt_logprobs"}


def test_a_grammar_step_copies_its_mask_over_without_waiting(llama_dir):
    """A grammar's step lands at once (its matcher needs the token on the host), but its
    launch queues the mask's copy like any other input."""
    from tandem.rollout import StructuredOutputsParams

    params = SamplingParams(**BASE, structured_outputs=StructuredOutputsParams(
        regex=r"[a-z ]{4,12}"))
    syncs = decode_syncs(engine_on_triton(llama_dir), params)
    assert [str(sync) for sync in syncs.syncs] == []
