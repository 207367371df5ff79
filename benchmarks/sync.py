"""Seconds and GB/s to push every weight of a model into a running engine, per sync path.

Models: the embedded SmolLM2-135M-Instruct, and a random model of Qwen2.5-0.5B's shape
(hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads, vocabulary 151936, tied
embeddings), saved once to a temporary folder and reused. Both run in float32 on CPU with
``torch.set_num_threads(2)`` (``--device cuda``: on the GPU in the checkpoint's dtype).

Paths:
- in-process copy: ``llm.update_weights(state.items())`` (a dict's items are staged by
  reference: one batched finiteness check, then one batched copy into the parameters).
- in-process copy, generator: the same tensors from a generator, each staged as a copy when
  it is read (what a trainer that gathers or reuses memory per weight gets).
- in-process alias: ``alias=True`` (the engine adopts the trainer's tensors; finiteness
  check only).
- two processes: ``WeightSender`` here, ``WeightReceiver`` in a spawned engine process,
  default bucket size, timed on the sender until the engine has committed; over gloo on
  CPU, over CUDA IPC with ``--device cuda`` (both processes on the one GPU).
- in-process LoRA merge (``tandem.sync.LoraSync``, rank 16 on every attention and MLP
  projection): GB counts the merged weights pushed, not the adapter.
- CPU repack: on CPU the linear layers multiply through packed copies of their weights
  (``kernels/cpu_linear.py``: panels for our C kernel, or oneDNN's packed format, whichever
  layout the engine timed fastest), rebuilt lazily by the first step after an update;
  the row times rebuilding every one of them after an in-process copy, a cost the update
  rows leave out and the next step pays. Measured before the alias row: an aliased engine
  serves unpacked weights from then on.
- in-process copy into an engine with 8-bit weights (``quantization`` int8 and fp8): the
  same float update, quantized in the commit; with its CPU repack (8-bit panels).

"Every weight" is the engine's parameters (tied embeddings once), as a trainer holds them.
Each path runs once untimed, then ``--repeats`` timed pushes; the median is kept.

Run::

    python benchmarks/sync.py
    python benchmarks/sync.py --repeats 5
    python benchmarks/sync.py --device cuda
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, Qwen2Config

from tandem.kernels.quantization import QUANTIZATIONS
from tandem.rollout import LLM
from tandem.rollout.default_model import embedded_model_dir
from tandem.sync import LoraSpec, LoraSync, WeightReceiver, WeightSender

NUM_THREADS = 2
HOST = "127.0.0.1"
TIMEOUT = timedelta(minutes=5)
ENGINE_OPTIONS = dict(max_model_len=256, num_kv_blocks=32, exact_logprobs=False)  # aliases
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN25_05B_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                        tie_word_embeddings=True, max_position_embeddings=32768)
ANCHORS = ("Published anchors (GPU, not comparable machines): vLLM's packed NCCL weight sync "
           "moves Qwen3-0.6B in about 0.18 s; TRL's per-parameter HTTP path took about 40 s "
           "for a 30B MoE.")


def qwen25_05b_shaped_folder() -> Path:
    """A random model of Qwen2.5-0.5B's shape, saved (bfloat16) once under the temp folder."""
    folder = Path(tempfile.gettempdir()) / "tandem-bench-qwen2.5-0.5b-shape"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B_SHAPE),
                                                 dtype=torch.bfloat16)
        model.save_pretrained(folder)
    return folder


def median_seconds(push: Callable[[], object], repeats: int, device: str) -> float:
    """One untimed push, then the median of ``repeats`` timed ones (device work included)."""
    push()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        push()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lora_adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A seeded rank-16 adapter on every projection weight of ``state``."""
    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for name, weight in state.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            out_features, in_features = weight.shape
            adapter[f"{module}.lora_A.weight"] = 0.01 * torch.randn(
                LORA_RANK, in_features, generator=generator)
            adapter[f"{module}.lora_B.weight"] = 0.01 * torch.randn(
                out_features, LORA_RANK, generator=generator)
    return adapter


def in_process_rows(folder: Path, repeats: int,
                    device: str) -> tuple[dict[str, torch.Tensor], list]:
    """The trainer's state (the engine's weights, cloned) and the in-process rows."""
    llm = LLM(str(folder), device=device, **ENGINE_OPTIONS)
    state = {n: p.detach().clone() for n, p in llm.engine.weight_parameters().items()}
    total = gigabytes(state.values())
    adapter = lora_adapter(state)
    merged = gigabytes(state[n.replace(".lora_A", "")] for n in adapter if ".lora_A" in n)
    lora = LoraSync(llm)
    spec = LoraSpec(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(PROJECTIONS))
    rows = [("in-process LoRA merge (r=16)", merged,
             median_seconds(lambda: lora.update(adapter.items(), spec), repeats, device))]
    rows.append(("in-process copy", total,
                 median_seconds(lambda: llm.update_weights(state.items()), repeats, device)))
    rows.append(("in-process copy, generator", total, median_seconds(
        lambda: llm.update_weights(item for item in state.items()), repeats, device)))
    if device == "cpu":
        rows.append(("CPU repack (next step)", total, repack_seconds(llm, state, repeats)))
    rows.append(("in-process alias", total, median_seconds(
        lambda: llm.update_weights(state.items(), alias=True), repeats, device)))
    return state, rows + quantized_rows(folder, state, repeats, device)


def quantized_rows(folder: Path, state: dict[str, torch.Tensor], repeats: int,
                   device: str) -> list:
    """The in-process copy (and on CPU the repack) into an engine of each 8-bit format."""
    rows, total = [], gigabytes(state.values())
    for method in QUANTIZATIONS:
        llm = LLM(str(folder), device=device, quantization=method, **ENGINE_OPTIONS)
        rows.append((f"in-process copy, {method} engine", total, median_seconds(
            lambda llm=llm: llm.update_weights(state.items()), repeats, device)))
        if device == "cpu":
            rows.append((f"CPU repack, {method} engine", total,
                         repack_seconds(llm, state, repeats)))
    return rows


def repack_seconds(llm: LLM, state: dict[str, torch.Tensor], repeats: int) -> float:
    """The median over ``repeats`` in-place updates (untimed) of rebuilding every packed copy
    of a weight, as the next step does."""
    packed = llm.engine.runner.model.packed_weights()
    times = []
    for _ in range(repeats):
        llm.update_weights(state.items())
        start = time.perf_counter()
        for weight in packed:
            weight.current()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_process(folder: str, port: int, updates: int, device: str) -> None:
    """The receiving engine: applies ``updates`` updates, then exits."""
    torch.set_num_threads(NUM_THREADS)
    llm = LLM(folder, device=device, **ENGINE_OPTIONS)
    receiver = WeightReceiver(llm, HOST, port, world_size=2, rank=1, timeout=TIMEOUT)
    for _ in range(updates):
        receiver.receive()


def two_process_row(folder: Path, state: dict[str, torch.Tensor], repeats: int,
                    device: str) -> tuple[str, float, float]:
    """The row of full pushes to an engine in another process (gloo or CUDA IPC)."""
    context = mp.get_context("spawn")
    port = free_port()
    engine = context.Process(target=engine_process,
                             args=(str(folder), port, repeats + 1, device))
    engine.start()
    sender = WeightSender(HOST, port, world_size=2, device=device, timeout=TIMEOUT)
    seconds = median_seconds(lambda: sender.send(state.items()), repeats, device)
    engine.join()
    return f"{sender.group.mode}, two processes", gigabytes(state.values()), seconds


def free_port() -> int:
    """A port free on ``HOST`` right now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def gigabytes(tensors) -> float:
    """The tensors' size in GB (10^9 bytes)."""
    return sum(tensor.nbytes for tensor in tensors) / 1e9


def main() -> None:
    """Measure every path on both models and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per path")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (engines and sender)")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    models = {"SmolLM2-135M (embedded)": Path(embedded_model_dir()),
              "Qwen2.5-0.5B shape (random)": qwen25_05b_shaped_folder()}
    print(f"{'model':<28} {'path':<32} {'GB':>6} {'seconds':>8} {'GB/s':>6}")
    for model, folder in models.items():
        state, rows = in_process_rows(folder, args.repeats, args.device)
        rows.append(two_process_row(folder, state, args.repeats, args.device))
        for path, size, seconds in rows:
            print(f"{model:<28} {path:<32} {size:>6.3f} {seconds:>8.3f} {size / seconds:>6.2f}",
                  flush=True)
    print(ANCHORS)


if __name__ == "__main__":
    main()
