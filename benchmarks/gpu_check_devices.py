"""The GPU check's multi-device section (issue 56), on two GPUs or more:

- TP=2 decode tokens/s at batch 1 and 64, with overlapped steps on and off.
- An engine on ``cuda:1`` (the process's current device stays ``cuda:0``): its greedy tokens
  in float32 equal the same engine's on ``cuda:0``.
- An NCCL update received during generation: a sender process on ``cuda:0`` pushes new
  weights to an engine on ``cuda:1`` (float32) while it decodes 8 sequences; after the
  commit its greedy tokens equal a fresh engine's loaded with the new weights.

With one device each part is recorded skipped ("one device"). With ``--smoke`` every part
runs on the CPU (TP=2 over gloo, the "second device" the CPU again, the update over gloo),
to check the section itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gpu_check_common import Recorder, collect, make_llm
from gpu_check_engine import greedy, random_prompts, same_linear_layout
from gpu_check_receive import decode_while_receiving, new_weights, receiving
from gpu_check_throughput import decode_overlap_rows

PARTS = ("TP=2 decode tok/s", "engine on cuda:1 = on cuda:0",
         "NCCL update during generation = fresh engine")


def check_devices(rec: Recorder, folder: Path, work: Path) -> None:
    """Every part on two devices; each recorded skipped with one (see the module docstring)."""
    if rec.device.type == "cuda" and torch.cuda.device_count() < 2:
        for part in PARTS:
            rec.record("devices", "skipped", part=part, reason="one device")
        return
    tensor_parallel_decode(rec, folder)
    collect()
    second_device(rec, folder)
    collect()
    update_during_generation(rec, folder, work)


def other_device(rec: Recorder) -> str:
    """The second device: ``cuda:1``, or the CPU again with ``--smoke``."""
    return "cpu" if rec.smoke else "cuda:1"


def tensor_parallel_decode(rec: Recorder, folder: Path) -> None:
    """TP=2 decode tokens/s, overlapped steps on and off."""
    llm = make_llm(rec, folder, tensor_parallel_size=2, max_num_seqs=16 if rec.smoke else 64)
    decode_overlap_rows(rec, "devices", PARTS[0], llm)
    del llm


def second_device(rec: Recorder, folder: Path) -> None:
    """Greedy tokens in float32 of an engine on the second device against one on the first."""
    prompts = random_prompts(8, 5, 60, seed=9)
    first = make_llm(rec, folder, dtype="float32")
    second = make_llm(rec, folder, device=other_device(rec), dtype="float32")
    same_linear_layout(second, first)
    first_tokens, second_tokens = (greedy(llm, prompts, 4 if rec.smoke else 32)
                                   for llm in (first, second))
    del first, second
    equal = sum(a == b for a, b in zip(first_tokens, second_tokens))
    rec.record("devices", PARTS[1], device=other_device(rec),
               equal_sequences=f"{equal}/{len(prompts)}", ok=equal == len(prompts))


def update_during_generation(rec: Recorder, folder: Path, work: Path) -> None:
    """New weights sent from the first device to an engine on the second while it decodes;
    its greedy tokens after the commit against a fresh engine on those weights (float32)."""
    device = other_device(rec)
    prompts = random_prompts(8, 5, 60, seed=10)
    llm = make_llm(rec, folder, device=device, dtype="float32")
    checkpoint = new_weights(llm, folder, work / "devices-update")
    with receiving(llm, checkpoint, 1, str(rec.device)) as updating:
        steps, _ = decode_while_receiving(llm, 8, updating, 16 if rec.smoke else 256)
    row = updating.row()
    got = greedy(llm, prompts, 4 if rec.smoke else 32)
    fresh = make_llm(rec, checkpoint.parent, device=device, dtype="float32")
    same_linear_layout(fresh, llm)
    want = greedy(fresh, prompts, 4 if rec.smoke else 32)
    del llm, fresh
    equal = sum(a == b for a, b in zip(got, want))
    rec.record("devices", PARTS[2], device=device, steps_during=steps, **row,
               equal_sequences=f"{equal}/{len(prompts)}",
               ok=row["error"] is None and row["updates"] == 1 and equal == len(prompts))
