"""A tensor-parallel worker process, started as
``python -m tandem.rollout.parallel.worker_process '<JSON arguments>'``.

Started by the driver (``executor.Workers``) with the runner's ``WorkerConfig``, its rank,
the driver's store port, import path and the model families registered there from outside
(``register_model``). It joins the engine's groups on its device (on CUDA the one ``rank``
places after the driver's), loads its shard of the weights, and then does what each
broadcast message says, until ``shutdown``. Any error ends the process
with its traceback, which the driver reports as the worker's exit.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from ..config import WorkerConfig
from ..worker.input_batch import StepInputs
from ..worker.model_runner import ModelRunner
from ..worker.models import register_model
from . import wire
from .tensor_parallel import TensorParallel, device_group, rank_device

# What a message may ask of the worker's runner (and nothing else).
RUNNER_OPS = ("allocate_kv_cache", "free_kv_cache", "offload_weights", "discard_weights",
              "reload_weights", "commit_slices", "set_lora", "full_weight", "capture_graphs")


def serve(args: dict[str, Any]) -> None:
    """Join the group, load this rank's shard, and run the driver's messages."""
    torch.set_num_threads(args["threads"])
    timeout = timedelta(seconds=args["timeout"])
    store = dist.TCPStore("127.0.0.1", args["port"], args["size"], False, timeout)
    store.set(f"joined/{args['rank']}", "1")
    rank, size = args["rank"], args["size"]
    device = rank_device(torch.device(args["config"]["device"]), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.ProcessGroupGloo(store, rank, size, timeout)
    tp = TensorParallel(rank, size, group, device_group(store, rank, size, timeout, device))
    config = replace(WorkerConfig.from_json(args["config"]), device=str(device))
    sys.path.extend(path for path in args["sys_path"] if path not in sys.path)
    for architecture, model in args["models"].items():
        register_model(architecture, model)
    runner = ModelRunner(config, AutoConfig.from_pretrained(config.model_dir), tp)
    while True:
        op, payload = wire.receive(group)
        if op == "shutdown":
            return
        if op == "step":
            runner.run_step(with_pending_ids(StepInputs(**payload), tp, device))
        elif op in RUNNER_OPS:
            getattr(runner, op)(**payload)
        else:
            raise ValueError(f"unknown tensor-parallel operation {op!r}")


def with_pending_ids(step: StepInputs, tp: TensorParallel, device: torch.device) -> StepInputs:
    """``step`` with the tokens of its pending rows, which the driver broadcasts over the
    device group right after the step (``DriverRunner.run_step``)."""
    if step.pending_rows:
        step.pending_ids = tp.broadcast(
            torch.empty(len(step.pending_rows), dtype=torch.long, device=device))
    return step


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
