"""The one-call GPU check: kernel errors, decode bandwidth, graphs against eager, nano-bench.

``benchmarks/gpu_check.sh OUT`` runs it on one GPU in at most five minutes, with no network:
models are random-weight models built from config shapes (Qwen3-0.6B's, written here). In
order of importance, each section appending its results to ``OUT/results.jsonl`` as it goes:

1. ``kernels``: every Triton kernel against its torch reference in float64 on random data at
   Qwen3-0.6B sizes, relative error ‖out − ref‖ / ‖ref‖, in bfloat16, float16 and float32;
   and the greedy tokens of the whole model, Triton (eager and graphs) against torch.
2. ``bandwidth``: paged decode attention at batch 256, context 1024 and 4096: bytes of K/V
   read per second against the measured device copy bandwidth (target: 60%).
3. ``decode``: engine decode tokens/s, eager against CUDA graphs, at batch 1, 8, 64, 256
   (target: graphs at least 2x eager at batch 8).
4. ``nano_bench``: DESIGN.md's workload (256 sequences, prompt and output lengths uniform in
   [100, 1024], ignore EOS) on the Qwen3-0.6B-shaped model, output tokens/s, beside
   transformers' ``generate`` on the same prompts (one left-padded batch, sampling all 256
   rows to the longest output length, stopped by ``max_time``).

A section that would overrun the time budget is skipped and says so; ``--table OUT`` prints
the table from whatever ``results.jsonl`` holds (the shell script calls it if the run is
killed). ``--smoke`` runs every section at toy sizes on a CPU (Triton under its
interpreter), to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from tandem.kernels import TORCH_OPS, AttentionMetadata, select_kernels  # noqa: E402
from tandem.kernels.testing import TOLERANCE, relative_error  # noqa: E402
from tandem.rollout import LLM, SamplingParams  # noqa: E402
from tandem.rollout.block_manager import num_blocks_for  # noqa: E402
from tandem.rollout.models.rotary import RotaryEmbedding  # noqa: E402

BUDGET_SECONDS = 280
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                 eos_token_id=151645)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
           tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)


class Recorder:
    """Appends each result to ``results.jsonl`` at once, so a killed run keeps what it had."""

    def __init__(self, out: Path, budget: float) -> None:
        self.path = out / "results.jsonl"
        self.deadline = time.monotonic() + budget
        out.mkdir(parents=True, exist_ok=True)

    def seconds_left(self) -> float:
        """Seconds until the budget runs out."""
        return self.deadline - time.monotonic()

    def record(self, section: str, name: str, **values) -> None:
        """Append one result row and echo it."""
        row = {"section": section, "name": name, **values}
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``call`` over ``repeats`` synchronised runs, after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------- 1. kernel errors


def paged_inputs(shape: dict, context_lens: list[int], query_lens: list[int], num_decodes: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = 16):
    """Random query and pool, shuffled block tables, metadata of one step."""
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = [num_blocks_for(c, block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, device=device, generator=generator)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(context_lens), width, dtype=torch.long, device=device)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = order[start:start + count]
        start += count
    kv_shape = (num_blocks, block_size, shape["num_key_value_heads"], shape["head_dim"])
    k_cache = torch.randn(kv_shape, device=device, generator=generator).to(dtype)
    v_cache = torch.randn(kv_shape, device=device, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), shape["num_attention_heads"], shape["head_dim"],
                        device=device, generator=generator).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device), block_tables=tables,
        context_lens=torch.tensor(context_lens, device=device),
        cu_seqlens_q=torch.tensor([0] + query_lens, device=device).cumsum(0),
        num_decodes=num_decodes, max_query_len=max(query_lens))
    return query, k_cache, v_cache, metadata


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


def check_attention(rec: Recorder, shape: dict, device: torch.device, smoke: bool) -> None:
    triton_ops = select_kernels("triton", device)
    scale = shape["head_dim"] ** -0.5
    for name, (context_lens, query_lens, num_decodes) in attention_cases(smoke).items():
        for dtype in TOLERANCE:
            query, k_cache, v_cache, metadata = paged_inputs(
                shape, context_lens, query_lens, num_decodes, dtype, device)
            out = triton_ops.paged_attention(query, k_cache, v_cache, metadata, scale)
            reference = TORCH_OPS.paged_attention(query.double(), k_cache.double(),
                                                  v_cache.double(), metadata, scale)
            record_error(rec, f"paged attention {name}", out, reference)


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the dtype as the results name it."""
    return str(dtype).removeprefix("torch.")


def record_error(rec: Recorder, name: str, out: torch.Tensor, reference: torch.Tensor) -> None:
    """Record ``out``'s relative error against ``reference`` and whether its dtype's
    tolerance holds it."""
    error = relative_error(out, reference)
    rec.record("kernels", name, dtype=dtype_name(out.dtype), rel_error=error,
               ok=error < TOLERANCE[out.dtype])


def check_layers(rec: Recorder, shape: dict, device: torch.device, smoke: bool) -> None:
    triton_ops = select_kernels("triton", device)
    tokens = 16 if smoke else 4096
    hidden, heads, kv_heads = (shape[k] for k in ("hidden_size", "num_attention_heads",
                                                  "num_key_value_heads"))
    head_dim = shape["head_dim"]
    generator = torch.Generator(device=device).manual_seed(1)
    for dtype in TOLERANCE:

        def randn(*size: int, dtype=dtype) -> torch.Tensor:
            return torch.randn(*size, device=device, generator=generator).to(dtype)

        x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        out, summed = triton_ops.rms_norm(x, weight, 1e-6, residual)
        ref_out, ref_sum = TORCH_OPS.rms_norm(x.double(), weight.double(), 1e-6,
                                              residual.double())
        record_error(rec, "rms_norm + residual", out, ref_out)
        record_error(rec, "residual add", summed, ref_sum)
        q_heads, q_weight = randn(tokens, heads, head_dim), randn(head_dim)
        record_error(rec, "rms_norm (q_norm)", triton_ops.rms_norm(q_heads, q_weight, 1e-6),
                     TORCH_OPS.rms_norm(q_heads.double(), q_weight.double(), 1e-6))
        gate, up = randn(tokens, shape["intermediate_size"]), randn(tokens,
                                                                     shape["intermediate_size"])
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


# ---------------------------------------------------------------- models and engines


def save_random_model(shape: dict, folder: Path, dtype: torch.dtype,
                      device: torch.device) -> torch.nn.Module:
    """A random-weight Qwen3 of ``shape`` saved to ``folder``; returns it (on ``device``)."""
    config = Qwen3Config(**shape)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return model.eval()


def make_llm(folder: Path, device: torch.device, smoke: bool, **options) -> LLM:
    sizing = {"num_kv_blocks": 512} if smoke else {"gpu_memory_utilization": 0.3}
    return LLM(str(folder), device=str(device), max_model_len=4096 if not smoke else 512,
               **(sizing | options))


def release(*objects) -> None:
    for obj in objects:
        del obj
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_engine_tokens(rec: Recorder, folder: Path, device: torch.device,
                        smoke: bool) -> None:
    """Greedy tokens of Triton (eager and graphs) against the torch backend, same model."""
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(5, 20 if smoke else 200, (3 if smoke else 8,),
                                      generator=generator)]
    params = SamplingParams(temperature=0, max_tokens=3 if smoke else 32, ignore_eos=True)
    runs = {"torch": dict(attention_backend="torch"),
            "triton eager": dict(attention_backend="triton", enforce_eager=True),
            "triton graphs": dict(attention_backend="triton")}
    tokens = {}
    for name, options in runs.items():
        llm = make_llm(folder, device, smoke, **options)
        tokens[name] = [o.outputs[0].token_ids for o in
                        llm.generate(prompts, params, use_tqdm=False)]
        release(llm)
    for name in ("triton eager", "triton graphs"):
        same = sum(a == b for a, b in zip(tokens[name], tokens["torch"]))
        rec.record("kernels", f"greedy tokens, {name} = torch",
                   equal_sequences=f"{same}/{len(prompts)}")


def check_tensor_parallel(rec: Recorder, folder: Path, device: torch.device,
                          smoke: bool) -> None:
    """Greedy tokens of TP=2 (eager, then decode graphs holding the NCCL all-reduces)
    against TP=1 (needs two GPUs; with --smoke, gloo on CPU)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        rec.record("tensor_parallel", "skipped",
                   reason=f"TP=2 needs two GPUs; {torch.cuda.device_count()} present")
        return
    prompts = [[5, 6, 7, 8], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=3 if smoke else 32, ignore_eos=True)
    tokens = {}
    for name, size, eager in (("TP=1", 1, False), ("TP=2 eager", 2, True),
                              ("TP=2 graphs", 2, False)):
        llm = make_llm(folder, device, smoke, tensor_parallel_size=size, enforce_eager=eager)
        tokens[name] = [o.outputs[0].token_ids for o in
                        llm.generate(prompts, params, use_tqdm=False)]
        graphs = len(llm.engine.runner.graph_sizes)
        release(llm)
        if size == 2:
            same = sum(a == b for a, b in zip(tokens[name], tokens["TP=1"]))
            rec.record("tensor_parallel", f"greedy tokens, {name} = TP=1",
                       equal_sequences=f"{same}/{len(prompts)}", graph_sizes=graphs)


def decode_tok_s(llm: LLM, batch: int, steps: int) -> float:
    """Decode tokens/s of ``batch`` sequences (128-token prompts), after their prefill."""
    engine = llm.engine
    request_ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        engine.add_request(request_id, [(7 * i + j) % 500 + 2 for j in range(128)],
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while min(engine.num_output_tokens(r) for r in request_ids) == 0:  # every prefill done
        engine.step()
    engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    for request_id in request_ids:
        engine.abort_request(request_id)
    return batch * steps / seconds


def check_decode(rec: Recorder, folder: Path, device: torch.device, smoke: bool) -> None:
    batches = [1, 2] if smoke else [1, 8, 64, 256]
    steps = 4 if smoke else 32
    modes = {"eager": True} if smoke else {"eager": True, "graphs": False}
    for mode, enforce_eager in modes.items():
        llm = make_llm(folder, device, smoke, enforce_eager=enforce_eager)
        stats = llm.stats()
        rec.record("decode", f"{mode} engine", graphs=stats["num_decode_graphs"],
                   capture_seconds=round(stats["graph_capture_seconds"], 2),
                   graph_bytes=stats["graph_bytes"],
                   planned_graph_bytes=stats.get("memory_graph_bytes", 0))
        for batch in batches:
            rec.record("decode", f"decode tok/s {mode}", batch=batch,
                       tok_s=round(decode_tok_s(llm, batch, steps), 1))
        release(llm)


# ---------------------------------------------------------------- 2. bandwidth


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy (read plus write)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / seconds_per_call(lambda: target.copy_(source), 10)


def check_bandwidth(rec: Recorder, shape: dict, device: torch.device, smoke: bool) -> None:
    from tandem.kernels.triton_attention import paged_decode_attention

    copy = copy_bandwidth(device, (1 << 20) if smoke else (2 << 30))
    rec.record("bandwidth", "device copy", gb_s=round(copy / 1e9, 1))
    batch = 4 if smoke else 256
    for context in ([64] if smoke else [1024, 4096]):
        query, k_cache, v_cache, metadata = paged_inputs(
            shape, [context] * batch, [1] * batch, batch, torch.bfloat16, device)
        decode = functools.partial(paged_decode_attention, query, k_cache, v_cache,
                                   metadata.block_tables, metadata.context_lens,
                                   shape["head_dim"] ** -0.5)
        seconds = seconds_per_call(decode, 3 if smoke else 20)
        kv_bytes = 2 * batch * context * k_cache[0, 0].numel() * k_cache.element_size()
        rec.record("bandwidth", "paged decode attention", batch=batch, context=context,
                   gb_s=round(kv_bytes / seconds / 1e9, 1),
                   of_copy=round(kv_bytes / seconds / copy, 3), microseconds=seconds * 1e6)


# ---------------------------------------------------------------- 4. nano-bench


def nano_bench_workload(num_seqs: int, low: int, high: int,
                        vocab_size: int) -> tuple[list, list[int]]:
    """Prompts of random ids below 10000 and output lengths, both lengths uniform in
    [low, high] (nano-vllm's bench)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(10000, vocab_size), (int(n),), generator=generator).tolist()
               for n in torch.randint(low, high + 1, (num_seqs,), generator=generator)]
    outputs = torch.randint(low, high + 1, (num_seqs,), generator=generator).tolist()
    return prompts, outputs


def check_nano_bench(rec: Recorder, folder: Path, hf_model: torch.nn.Module,
                     device: torch.device, smoke: bool) -> None:
    prompts, output_lens = nano_bench_workload(*((4, 10, 30) if smoke else (256, 100, 1024)),
                                               hf_model.config.vocab_size)
    llm = LLM(str(folder), device=str(device), max_model_len=2048 if not smoke else 512,
              **({"num_kv_blocks": 512} if smoke else {"gpu_memory_utilization": 0.6}))
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)
              for n in output_lens]
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rec.record("nano_bench", "tandem", tokens=tokens, seconds=round(seconds, 2),
               tok_s=round(tokens / seconds, 1), preemptions=llm.stats()["preemptions"])
    release(llm, outputs)
    time_cap = 5.0 if smoke else max(10.0, min(60.0, rec.seconds_left() - 15))
    hf_tokens, hf_seconds = hf_generate(hf_model, prompts, max(output_lens), time_cap)
    rec.record("nano_bench", "transformers generate", tokens=hf_tokens,
               seconds=round(hf_seconds, 2), tok_s=round(hf_tokens / hf_seconds, 1),
               max_time=time_cap)


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                max_time: float) -> tuple[int, float]:
    """transformers ``generate`` on the prompts as one left-padded batch, sampling at 0.6.

    Every row generates until ``max_new_tokens`` or ``max_time``; returns (tokens, seconds).
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=device)
    options = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4,
                       min_new_tokens=4, **options)
        sync()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, max_time=max_time, **options)
        sync()
    return (out.shape[1] - width) * len(prompts), time.perf_counter() - start


# ---------------------------------------------------------------- table and main


def print_table(out: Path) -> None:
    """Print every recorded result as a Markdown table (also saved as ``table.md``)."""
    path = out / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    lines = ["| section | check | results |", "|---|---|---|"]
    for row in rows:
        values = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("section", "name"))
        lines.append(f"| {row['section']} | {row['name']} | {values} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)


def run_section(rec: Recorder, name: str, needs_seconds: float, call: Callable[[], None]) -> None:
    """Run a section unless the budget cannot hold it; record a skip or a failure."""
    if rec.seconds_left() < needs_seconds:
        rec.record(name, "skipped", reason=f"under {needs_seconds:.0f} s of budget left")
        return
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # a broken section must not hide the others' results
        rec.record(name, "failed", error=f"{type(error).__name__}: {error}"[:500])
    rec.record(name, "section seconds", seconds=round(time.monotonic() - start, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for results.jsonl and table.md")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on CPU (Triton interpreter): checks the script")
    parser.add_argument("--table", action="store_true",
                        help="only print the table of what OUT/results.jsonl holds")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                        help="seconds the whole check may take")
    args = parser.parse_args()
    if args.table:
        print_table(args.out)
        return
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    rec = Recorder(args.out, args.budget)
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = TOY if args.smoke else QWEN3_06B
    rec.record("setup", "device", card="cpu" if args.smoke else torch.cuda.get_device_name(),
               torch=torch.__version__, smoke=args.smoke)
    run_section(rec, "kernels", 20, lambda: (check_attention(rec, shape, device, args.smoke),
                                             check_layers(rec, shape, device, args.smoke)))
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "qwen3-0.6b-random"
    hf_model = save_random_model(shape, folder, torch.float32 if args.smoke else torch.bfloat16,
                                 device)
    run_section(rec, "kernels", 40, lambda: check_engine_tokens(rec, folder, device, args.smoke))
    run_section(rec, "bandwidth", 15, lambda: check_bandwidth(rec, shape, device, args.smoke))
    run_section(rec, "decode", 50, lambda: check_decode(rec, folder, device, args.smoke))
    run_section(rec, "nano_bench", 60,
                lambda: check_nano_bench(rec, folder, hf_model, device, args.smoke))
    run_section(rec, "tensor_parallel", 30,
                lambda: check_tensor_parallel(rec, folder, device, args.smoke))
    print_table(args.out)


if __name__ == "__main__":
    main()
