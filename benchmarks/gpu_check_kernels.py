"""The GPU check's kernel sections: each Triton kernel against its float64 torch reference,
decode attention bandwidth against the device copy, prefill attention against torch's
flash attention on the Qwen3-8B shape, the FP8 KV cache (its store's bits, attention over an
FP8 pool against float64, its decode bandwidth, an engine against the unquantized one), and
the compiled kernels' registers and spills."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from gpu_check_common import QWEN3_8B, Recorder, collect, dtype_name, make_llm, seconds_per_call
from transformers import Qwen3Config

from tandem.kernels import TORCH_OPS, AttentionMetadata, pool_layout, select_kernels
from tandem.kernels.fp8_kv import FP8, MIN_CUDA_CAPABILITY, quantize
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import SamplingParams
from tandem.rollout.core.block_manager import num_blocks_for
from tandem.rollout.worker.models.rotary import RotaryEmbedding


def paged_inputs(shape: dict, context_lens: list[int], query_lens: list[int], num_decodes: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = 16):
    """Random query and pool (stored head-major, as the engine's), shuffled block tables, and
    the metadata of one step."""
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = [num_blocks_for(c, block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, device=device, generator=generator)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.long,
                         device=device)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = order[start:start + count]
        start += count
    storage, permutation = pool_layout((num_blocks, block_size, shape["num_key_value_heads"],
                                        shape["head_dim"]))

    def pool() -> torch.Tensor:
        return torch.randn(storage, device=device, generator=generator).to(dtype).permute(
            permutation)

    query = torch.randn(sum(query_lens), shape["num_attention_heads"], shape["head_dim"],
                        device=device, generator=generator).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device), block_tables=tables,
        context_lens=torch.tensor(context_lens, device=device),
        cu_seqlens_q=torch.tensor([0] + query_lens, device=device).cumsum(0),
        num_decodes=num_decodes, max_query_len=max(query_lens))
    return query, pool(), pool(), metadata


def attention_cases(smoke: bool) -> dict[str, tuple[list[int], list[int], int]]:
    """Name -> (context lengths, query lengths, number of decodes)."""
    if smoke:
        return {"decode": ([1, 16, 40], [1, 1, 1], 3),
                "decode split-K": ([200, 300], [1, 1], 2),
                "prefill/extend": ([20, 40, 33], [20, 7, 1], 0)}
    generator = torch.Generator().manual_seed(0)
    decode_lens = torch.randint(1, 2049, (64,), generator=generator).tolist()
    prefill = [(512, 512), (300, 1000), (1, 77), (64, 64), (1024, 3000), (17, 33)]
    return {"decode": (decode_lens, [1] * 64, 64),
            "decode split-K": ([4096, 8000, 6000, 1], [1] * 4, 4),
            "prefill/extend": ([c for _, c in prefill], [q for q, _ in prefill], 0)}


def record_error(rec: Recorder, name: str, out: torch.Tensor, reference: torch.Tensor) -> None:
    """Record ``out``'s relative error against ``reference`` and whether its dtype's
    tolerance holds it."""
    error = relative_error(out, reference)
    rec.record("kernels", name, dtype=dtype_name(out.dtype), rel_error=error,
               ok=error < TOLERANCE[out.dtype])


def check_kernels(rec: Recorder, shape: dict) -> None:
    """Every Triton kernel against its torch reference in float64, in each dtype."""
    check_attention(rec, shape)
    check_layers(rec, shape)


def check_attention(rec: Recorder, shape: dict) -> None:
    triton_ops = select_kernels("triton", rec.device)
    scale = shape["head_dim"] ** -0.5
    for name, (context_lens, query_lens, num_decodes) in attention_cases(rec.smoke).items():
        for dtype in TOLERANCE:
            query, k_cache, v_cache, metadata = paged_inputs(
                shape, context_lens, query_lens, num_decodes, dtype, rec.device)
            out = triton_ops.paged_attention(query, k_cache, v_cache, metadata, scale)
            reference = TORCH_OPS.paged_attention(query.double(), k_cache.double(),
                                                  v_cache.double(), metadata, scale)
            record_error(rec, f"paged attention {name}", out, reference)


def check_layers(rec: Recorder, shape: dict) -> None:
    triton_ops = select_kernels("triton", rec.device)
    tokens = 16 if rec.smoke else 4096
    hidden, heads, kv_heads, head_dim = (shape[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    generator = torch.Generator(device=rec.device).manual_seed(1)
    for dtype in TOLERANCE:

        def randn(*size: int, dtype=dtype) -> torch.Tensor:
            return torch.randn(*size, device=rec.device, generator=generator).to(dtype)

        x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        out, summed = triton_ops.rms_norm(x, weight, 1e-6, residual)
        ref_out, ref_sum = TORCH_OPS.rms_norm(x.double(), weight.double(), 1e-6,
                                              residual.double())
        record_error(rec, "rms_norm + residual", out, ref_out)
        record_error(rec, "residual add", summed, ref_sum)
        q_heads, q_weight = randn(tokens, heads, head_dim), randn(head_dim)
        record_error(rec, "rms_norm (q_norm)", triton_ops.rms_norm(q_heads, q_weight, 1e-6),
                     TORCH_OPS.rms_norm(q_heads.double(), q_weight.double(), 1e-6))
        gate, up = (randn(tokens, shape["intermediate_size"]) for _ in range(2))
        record_error(rec, "silu_and_mul", triton_ops.silu_and_mul(gate, up),
                     TORCH_OPS.silu_and_mul(gate.double(), up.double()))
        check_rotary(rec, triton_ops, randn(tokens, heads, head_dim),
                     randn(tokens, kv_heads, head_dim), shape)
        check_store_kv(rec, triton_ops, randn(tokens, kv_heads, head_dim),
                       randn(tokens, kv_heads, head_dim))


def check_rotary(rec: Recorder, triton_ops, query: torch.Tensor, key: torch.Tensor,
                 shape: dict) -> None:
    device = query.device
    tables = RotaryEmbedding(Qwen3Config(**shape), shape["head_dim"], 4096, device)
    positions = torch.randint(0, 4096, (query.shape[0],), device=device)
    ref_query, ref_key = query.double(), key.double()
    TORCH_OPS.rotary_embedding(positions, ref_query, ref_key, tables.cos.double(),
                               tables.sin.double())
    triton_ops.rotary_embedding(positions, query, key, tables.cos, tables.sin)
    record_error(rec, "rotary (query)", query, ref_query)
    record_error(rec, "rotary (key)", key, ref_key)


def check_store_kv(rec: Recorder, triton_ops, key: torch.Tensor, value: torch.Tensor) -> None:
    num_tokens, kv_heads, head_dim = key.shape
    device = key.device
    k_cache = torch.zeros(num_tokens // 8 + 4, 16, kv_heads, head_dim, dtype=key.dtype,
                          device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=device)[:num_tokens]
    slots[::7] = -1
    triton_ops.store_kv(key, value, k_cache, v_cache, slots)
    written = slots >= 0
    exact = (torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots[written]], key[written])
             and torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots[written]],
                             value[written])
             and int((k_cache != 0).any(-1).any(-1).sum()) == int(written.sum()))
    rec.record("kernels", "store_kv (exact, -1 skipped)", dtype=dtype_name(key.dtype),
               rel_error=0.0 if exact else float("inf"), ok=exact)


def copy_bandwidth(rec: Recorder) -> float:
    """Bytes per second of a device-to-device copy (read plus write) of 2 GiB (1 MiB with
    --smoke), measured once per run."""
    return _copy_bandwidth(rec.device, (1 << 20) if rec.smoke else (2 << 30))


@functools.cache
def _copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / seconds_per_call(lambda: target.copy_(source), 10)


def decode_bandwidth(rec: Recorder, section: str, shape: dict, batch: int, context: int,
                     copy: float, fp8: bool = False, window: int | None = None) -> float:
    """Record paged decode attention's K/V bytes read per second, against ``copy``, over a
    bfloat16 pool or (``fp8``) an FP8 one, under a sliding ``window`` (the bytes its last
    ``window`` keys hold) or none; returns the seconds per call."""
    from tandem.kernels.triton_attention import paged_decode_attention

    query, k_cache, v_cache, metadata = paged_inputs(
        shape, [context] * batch, [1] * batch, batch, torch.bfloat16, rec.device)
    scales = {}
    if fp8:
        (k_cache, k_scale, _), (v_cache, v_scale, _) = (fp8_pool(cache) for cache in
                                                        (k_cache, v_cache))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    decode = functools.partial(paged_decode_attention, query, k_cache, v_cache,
                               metadata.block_tables, metadata.context_lens,
                               shape["head_dim"] ** -0.5, sliding_window=window, **scales)
    seconds = seconds_per_call(decode, 3 if rec.smoke else 20)
    keys = min(context, window or context)
    kv_bytes = 2 * batch * keys * k_cache[0, 0].numel() * k_cache.element_size()
    name = "paged decode attention" + (" (FP8 pool)" if fp8 else "") + \
        (f" (window {window})" if window else "")
    rec.record(section, name, batch=batch, context=context,
               gb_s=round(kv_bytes / seconds / 1e9, 1),
               of_copy=round(kv_bytes / seconds / copy, 3), microseconds=seconds * 1e6)
    return seconds


def check_bandwidth(rec: Recorder, shape: dict) -> None:
    """Decode attention at batch 256, contexts 1k and 4k, against the device copy."""
    copy = copy_bandwidth(rec)
    rec.record("bandwidth", "device copy", gb_s=round(copy / 1e9, 1))
    for context in [64] if rec.smoke else [1024, 4096]:
        decode_bandwidth(rec, "bandwidth", shape, 4 if rec.smoke else 256, context, copy)


def check_sliding(rec: Recorder, shape: dict) -> None:
    """Sliding-window decode at 4k and 32k contexts: GPT-OSS's window (128) and Gemma 3's
    (1024), the window's K/V bytes per second against the device copy, and the same
    contexts without a window (a window's decode must cost its window, not the context)."""
    copy = copy_bandwidth(rec)
    batch = 4 if rec.smoke else 32
    for context in [64] if rec.smoke else [4096, 32768]:
        full = decode_bandwidth(rec, "sliding", shape, batch, context, copy)
        for window in [16] if rec.smoke else [128, 1024]:
            seconds = decode_bandwidth(rec, "sliding", shape, batch, context, copy,
                                       window=window)
            rec.record("sliding", f"window {window} against full", context=context,
                       speedup=round(full / seconds, 2))


def fp8_pool(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cache`` ``[blocks, block_size, kv_heads, head_dim]`` (head-major, as the engine's)
    stored in FP8 by a random scale per KV head, laid out alike: the pool, its scales, and
    the values it holds dequantized in float64 (what the kernels must attend over)."""
    generator = torch.Generator(device=cache.device).manual_seed(2)
    scale = torch.rand(cache.shape[2], device=cache.device, generator=generator) + 0.5
    stored = torch.empty_like(cache, dtype=FP8)  # the same strides: head-major
    stored.flatten(0, 1).copy_(quantize(cache.flatten(0, 1), scale))
    return stored, scale, stored.double() * scale.double()[:, None]


def check_fp8_kv(rec: Recorder, shape: dict, folder: Path) -> None:
    """The FP8 KV cache (``kv_cache_dtype="fp8"``): Triton's store against
    ``fp8_kv.quantize`` bit for bit; attention (decodes, the split decode, prefills, the
    batch-invariant path) over an FP8 pool against float64 attention over the values it
    holds; decode attention's bandwidth over an FP8 pool against a bfloat16 one (batch 256,
    context 4k: half the bytes); an engine's log-probs against the unquantized engine's."""
    if rec.device.type == "cuda" and torch.cuda.get_device_capability() < MIN_CUDA_CAPABILITY:
        rec.record("fp8_kv", "skipped", reason="Triton converts float8_e4m3fn from sm_89 on")
        return
    kernels = {"paged attention": select_kernels("triton", rec.device),
               "batch-invariant attention": select_kernels("triton", rec.device, exact=True)}
    check_fp8_store(rec, kernels["paged attention"], shape)
    scale = shape["head_dim"] ** -0.5
    for name, (context_lens, query_lens, num_decodes) in attention_cases(rec.smoke).items():
        for dtype in TOLERANCE:
            query, k_cache, v_cache, metadata = paged_inputs(
                shape, context_lens, query_lens, num_decodes, dtype, rec.device)
            (k_pool, k_scale, k_values), (v_pool, v_scale, v_values) = (
                fp8_pool(cache) for cache in (k_cache, v_cache))
            reference = TORCH_OPS.paged_attention(query.double(), k_values, v_values, metadata,
                                                  scale)
            for kernel, ops in kernels.items():
                out = ops.paged_attention(query, k_pool, v_pool, metadata, scale, k_scale,
                                          v_scale)
                error = relative_error(out, reference)
                rec.record("fp8_kv", f"{kernel} {name}", dtype=dtype_name(dtype),
                           rel_error=error, ok=error < TOLERANCE[dtype])
    copy = copy_bandwidth(rec)
    batch, context = (4, 64) if rec.smoke else (256, 4096)
    bf16 = decode_bandwidth(rec, "fp8_kv", shape, batch, context, copy)
    fp8 = decode_bandwidth(rec, "fp8_kv", shape, batch, context, copy, fp8=True)
    rec.record("fp8_kv", "decode attention, FP8 pool over bfloat16", batch=batch,
               context=context, speedup=round(bf16 / fp8, 3))
    collect()
    check_fp8_engine(rec, folder)


def check_fp8_store(rec: Recorder, triton_ops, shape: dict) -> None:
    """Triton's store into an FP8 pool: every written slot ``quantize``'s bits, values
    across e4m3's range (beyond it saturated), padding slots (-1) skipped."""
    device, kv_heads, head_dim = rec.device, shape["num_key_value_heads"], shape["head_dim"]
    tokens = 16 if rec.smoke else 4096
    generator = torch.Generator(device=device).manual_seed(3)
    exponents = torch.randint(-14, 12, (2, tokens, kv_heads, head_dim), device=device,
                              generator=generator)
    key, value = ((torch.randn(tokens, kv_heads, head_dim, device=device, generator=generator)
                   * torch.exp2(exponents[i].float())).to(torch.bfloat16) for i in range(2))
    scales = [torch.rand(kv_heads, device=device, generator=generator) + 0.5 for _ in range(2)]
    k_cache = torch.zeros(tokens // 8 + 4, 16, kv_heads, head_dim, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=device)[:tokens]
    slots[::7] = -1
    triton_ops.store_kv(key, value, k_cache, v_cache, slots, *scales)
    written = slots >= 0
    exact = all(torch.equal(cache.view(-1, kv_heads, head_dim)[slots[written]].view(torch.uint8),
                            quantize(rows[written], scale).view(torch.uint8))
                for cache, rows, scale in ((k_cache, key, scales[0]), (v_cache, value, scales[1])))
    rec.record("fp8_kv", "store_kv into FP8 (quantize's bits, -1 skipped)",
               rel_error=0.0 if exact else float("inf"), ok=exact)


def check_fp8_engine(rec: Recorder, folder: Path) -> None:
    """An FP8 engine (its decode graphs captured over the FP8 pool, a group of 2 sharing its
    prompt) along the unquantized engine's greedy completions: the share of positions where
    its most likely token is the same, and the mean |difference| of the log-probs. The
    check's random-weight model makes these figures of the plumbing, not of accuracy
    (benchmarks/kv_cache_fp8.py measures that on a trained model)."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + 30 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8 if rec.smoke else 32, ignore_eos=True,
                            logprobs=0)
    reference = make_llm(rec, folder)
    completions = [o.outputs[0] for o in reference.generate(prompts, greedy, use_tqdm=False)]
    del reference
    collect()
    llm = make_llm(rec, folder, kv_cache_dtype="fp8")
    group = llm.generate(prompts[:1], SamplingParams(n=2, max_tokens=8, seed=0), use_tqdm=False)
    scored = llm.generate([p + c.token_ids for p, c in zip(prompts, completions)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, differences = [], []
    for prompt, completion, output in zip(prompts, completions, scored):
        for j, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            entry = output.prompt_logprobs[len(prompt) + j]
            agree.append(max(entry, key=entry.get) == token)
            differences.append(abs(entry[token] - logprob))
    mean_difference = sum(differences) / len(differences)
    rec.record("fp8_kv", "engine along the unquantized engine's greedy tokens",
               top1_agreement=round(sum(agree) / len(agree), 3),
               mean_abs_logprob_diff=round(mean_difference, 4),
               decode_graphs=llm.stats()["num_decode_graphs"],
               cow_copies=llm.stats()["cow_copies"],
               ok=math.isfinite(mean_difference) and len(group[0].outputs) == 2)


def check_long_attention(rec: Recorder) -> None:
    """The Qwen3-8B shape's attention: a causal prefill of one sequence at 8k and 32k against
    torch's flash attention (TFLOP/s, target 0.8x), and decode at 32k against copy bandwidth."""
    shape = QWEN3_8B
    contexts = [32, 64] if rec.smoke else [8192, 32768]
    for context in contexts:
        prefill_against_sdpa(rec, shape, context)
    decode_bandwidth(rec, "qwen3_8b", shape, 2 if rec.smoke else 16, contexts[-1],
                     copy_bandwidth(rec))


def prefill_against_sdpa(rec: Recorder, shape: dict, context: int) -> None:
    """One sequence's causal prefill of ``context`` tokens: Tandem's Triton kernel over the
    paged pool against ``scaled_dot_product_attention`` (flash backend on CUDA) on the same
    values, in bfloat16; TFLOP/s counts the causal half (2 · L² · heads · head_dim)."""
    dtype = torch.float32 if rec.smoke else torch.bfloat16
    query, k_cache, v_cache, metadata = paged_inputs(shape, [context], [context], 0, dtype,
                                                     rec.device)
    triton_ops = select_kernels("triton", rec.device)
    scale = shape["head_dim"] ** -0.5
    ours = functools.partial(triton_ops.paged_attention, query, k_cache, v_cache, metadata,
                             scale)
    q, k, v = contiguous_heads(query, k_cache, v_cache, metadata, shape)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                             is_causal=True, scale=scale)
    repeats = 1 if rec.smoke else 5
    with flash_backend(rec.device):
        reference = sdpa()
        sdpa_seconds = seconds_per_call(sdpa, repeats)
    out = ours()
    our_seconds = seconds_per_call(ours, repeats)
    flops = 2 * context * context * shape["num_attention_heads"] * shape["head_dim"]
    error = relative_error(out, reference[0].transpose(0, 1))
    rec.record("qwen3_8b", "prefill attention against SDPA flash", context=context,
               tflop_s=round(flops / our_seconds / 1e12, 1),
               sdpa_tflop_s=round(flops / sdpa_seconds / 1e12, 1),
               of_sdpa=round(sdpa_seconds / our_seconds, 3), rel_error_to_sdpa=error,
               ok=error < 2 * TOLERANCE[dtype])


def contiguous_heads(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     metadata: AttentionMetadata, shape: dict) -> tuple[torch.Tensor, ...]:
    """One sequence's query, keys and values as SDPA takes them ``[1, heads, L, head_dim]``,
    the KV heads repeated for each query head of their group."""
    context = int(metadata.context_lens[0])
    blocks = metadata.block_tables[0, :math.ceil(context / k_cache.shape[1])]
    group = shape["num_attention_heads"] // shape["num_key_value_heads"]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[blocks].flatten(0, 1)[:context]  # [L, kv_heads, head_dim]
        return rows.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()

    return query.transpose(0, 1).unsqueeze(0).contiguous(), gather(k_cache), gather(v_cache)


def flash_backend(device: torch.device):
    """SDPA restricted to its flash backend on CUDA (any backend on CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return sdpa_kernel([SDPBackend.MATH])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def check_resources(rec: Recorder) -> None:
    """Registers, spills and shared memory of every Triton kernel compiled so far in this
    process (the driver's figures; none under the interpreter)."""
    from tandem.kernels import triton_attention, triton_layers

    kernels = 0
    for module in (triton_attention, triton_layers):
        for name, function in vars(module).items():
            for compiled in compiled_kernels(function):
                kernels += 1
                spills = int(getattr(compiled, "n_spills", 0) or 0)
                rec.record("resources", name, registers=getattr(compiled, "n_regs", None),
                           spills=spills, shared_bytes=compiled.metadata.shared,
                           num_warps=compiled.metadata.num_warps, ok=spills == 0)
    if not kernels:
        rec.record("resources", "no compiled kernels",
                   reason="the interpreter compiles nothing" if rec.smoke else "none ran")


def compiled_kernels(function) -> list:
    """The compiled kernels a ``@triton.jit`` function holds, every device and key."""
    caches = getattr(function, "device_caches", None)
    if not isinstance(caches, dict):
        return []
    kernels = []
    for cache in caches.values():
        per_key = cache[0] if isinstance(cache, tuple) else cache
        kernels += [kernel for kernel in per_key.values() if hasattr(kernel, "metadata")]
    return kernels
