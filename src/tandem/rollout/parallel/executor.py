"""The driver side of a tensor-parallel engine: its worker processes, and a runner that does
every operation on them too (vLLM's multiprocess executor is the model).

The driver (rank 0, the engine's own process) schedules, runs its shard and samples. It
starts ``size - 1`` workers (``python -m tandem.rollout.parallel.worker_process``, arguments
as JSON), which join the engine's groups (``tensor_parallel``) through a TCP store on
127.0.0.1 (independent of any default process group, so a trainer's torch.distributed is
untouched). Each step the driver broadcasts the step as its host knows it (``wire.py``, over
gloo), then the pending tokens its decodes read from the last step's samples, device to
device (over the device group: NCCL on CUDA), so its host never waits for the device; the
workers run their shards (or replay their decode graphs, captured together with the
driver's), the all-reduces meet, and the LM head's vocabulary slices are gathered on the
driver. A worker that dies or stops answering is reported within ``timeout`` as a
``TensorParallelError`` naming it; the workers are shut down when the runner is collected or
the process exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from tandem.kernels import check_sharded, select_kernels
from tandem.sync.protocol import WeightUpdateError

from ..config import WorkerConfig
from ..worker.input_batch import StepInputs
from ..worker.model_runner import ModelRunner
from ..worker.models import external_models
from . import wire
from .tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    device_group,
    full_shape,
    spmd_group,
)

TIMEOUT_ENV = "TANDEM_TP_TIMEOUT"  # seconds; a step must finish within it on every rank
DEFAULT_TIMEOUT_S = 300.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the engine cannot go on."""


def make_runner(config: WorkerConfig, hf_config: PretrainedConfig, size: int = 1,
                spmd: bool = False) -> ModelRunner:
    """The engine's runner: a ``ModelRunner``, or with ``size > 1`` (tensor parallelism)
    a ``DriverRunner`` with its workers started, or with ``spmd`` this rank's
    ``ShardedRunner`` of a torchrun world.

    Raises:
        ValueError: for a tensor-parallel size the model, machine or kernels cannot run.
    """
    device = config.torch_device
    check_tensor_parallel(size, hf_config, device, spmd)
    if size > 1:
        check_sharded(select_kernels(config.attention_backend, device), device)
    if size == 1:
        return ModelRunner(config, hf_config)
    if spmd:
        return ShardedRunner(config, hf_config, spmd_group(size, device))
    threads = max(1, (os.cpu_count() or 1) // size)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    return DriverRunner(Workers(config, size, threads), config, hf_config)


class Workers:
    """The worker processes of one engine and the group the driver shares with them."""

    def __init__(self, config: WorkerConfig, size: int, threads: int) -> None:
        self.timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        timeout = timedelta(seconds=self.timeout)
        device = config.torch_device
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
        # The driver's import path and the model families registered in it from outside
        # the package, so a family a test or a user's module defines runs on every rank.
        shared = {"config": config.as_json(), "models": external_models(),
                  "sys_path": sys.path, "threads": threads, "size": size,
                  "port": store.port, "timeout": self.timeout}
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "tandem.rollout.parallel.worker_process", json.dumps(
                {**shared, "rank": rank})]) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _stop, self.processes)
        self._wait_joined(store, size)
        try:
            group = dist.ProcessGroupGloo(store, 0, size, timeout)
            tensors = device_group(store, 0, size, timeout, device)
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        self.tp = TensorParallel(0, size, group, tensors)
        self.store = store

    def _wait_joined(self, store: dist.TCPStore, size: int) -> None:
        """Wait until every worker reached the store, reporting one that exits first (the
        group's own wait would only end at the timeout)."""
        keys = [f"joined/{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + self.timeout
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise self.failure(TimeoutError("the workers did not start"))
            time.sleep(0.05)

    def send(self, op: str, payload: dict[str, Any]) -> None:
        """Broadcast an operation to every worker.

        Raises:
            TensorParallelError: when a worker is gone.
        """
        self.check()
        try:
            wire.send(self.tp.group, op, payload)
        except RuntimeError as exc:
            raise self.failure(exc) from exc

    def check(self) -> None:
        """Raise ``TensorParallelError`` if a worker has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited with code {process.returncode}"
                    " (its error is above in the output); start a new engine.")

    def failure(self, exc: Exception) -> TensorParallelError:
        """The error to raise for a collective that failed with ``exc``."""
        try:
            self.check()
        except TensorParallelError as dead:
            return dead
        return TensorParallelError(
            f"a tensor-parallel worker did not answer within {self.timeout:.0f} s ({exc}); "
            f"raise {TIMEOUT_ENV} if a step may take longer, or start a new engine.")

    def close(self) -> None:
        """Ask the workers to exit, then make sure they did."""
        try:
            if all(process.poll() is None for process in self.processes):
                wire.send(self.tp.group, "shutdown", {})
        except RuntimeError:
            pass
        self._finalizer()


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ShardedRunner(ModelRunner):
    """A runner of one rank of a tensor-parallel engine: updates are checked against full
    shapes and each rank applies its slices. Itself the runner of every rank of an SPMD
    engine (``distributed_executor_backend="external_launcher"``), where each process of a
    torchrun world runs the same requests and steps in step."""

    def weight_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in its full (Hugging Face) shape, dtype and device, as a stand-in
        that takes no memory (a scalar expanded): updates are checked against it, then each
        rank cuts its slice (``commit_weights``)."""
        config, spec = self.model.config, self.weight_spec
        return {name: torch.empty((), dtype=p.dtype, device=p.device).expand(
            full_shape(spec[name].split, tuple(p.shape), config, self.tp))
            for name, p in super().weight_parameters().items()}

    def commit_weights(self, staged: dict[str, torch.Tensor], alias: bool) -> bool:
        """Every rank cuts, checks and votes on its slices of the full tensors (the
        driver's workers get them from it, SPMD ranks have their own), and all apply or
        none do.

        Raises:
            WeightUpdateError: for ``alias``, or when a rank refused its slices.
        """
        if alias:
            raise WeightUpdateError("alias updates cannot be sliced per rank: update by copy "
                                    "under tensor parallelism.")
        self.share_staged(staged)
        refusing = self.commit_slices(staged)
        if refusing:
            raise WeightUpdateError(f"tensor-parallel rank(s) {refusing} refused their slices "
                                    "(non-finite values); no rank applied the update.")
        return False

    def share_staged(self, staged: dict[str, torch.Tensor]) -> None:
        """Give the other ranks what this one commits (SPMD ranks have their own)."""


class DriverRunner(ShardedRunner):
    """Rank 0's runner: each operation that touches the model or the KV pool is sent to the
    workers first, then done here; a failed collective becomes a ``TensorParallelError``."""

    def __init__(self, workers: Workers, config: WorkerConfig,
                 hf_config: PretrainedConfig) -> None:
        self.workers = workers
        super().__init__(config, hf_config, workers.tp)
        weakref.finalize(self, workers.close)

    def share_staged(self, staged: dict[str, torch.Tensor]) -> None:
        """Send the full staged tensors to every worker."""
        self.workers.send("commit_slices", {"staged": staged})

    def commit_weights(self, staged: dict[str, torch.Tensor], alias: bool) -> bool:
        """As ``ShardedRunner.commit_weights``; a failed collective is a
        ``TensorParallelError``."""
        try:
            return super().commit_weights(staged, alias)
        except WeightUpdateError:  # a refusal (a RuntimeError too), not a lost worker
            raise
        except RuntimeError as exc:
            raise self.workers.failure(exc) from exc

    def run_step(self, step: StepInputs) -> torch.Tensor | None:
        """Broadcast the step as the host knows it (host tensors: nothing read back from the
        device), then its pending tokens over the device group, then run this rank's shard
        of it."""
        self.workers.send("step", {name: getattr(step, name) for name in StepInputs.__slots__
                                   if name != "pending_ids"})
        try:
            if step.pending_rows:
                self.tp.broadcast(step.pending_ids)
            return super().run_step(step)
        except RuntimeError as exc:
            raise self.workers.failure(exc) from exc

    def set_lora(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Send the full adapter factors to every worker; each rank applies its slice."""
        self.workers.send("set_lora", {"factors": {name: list(given)
                                                   for name, given in factors.items()}})
        super().set_lora(factors)

    def full_weight(self, name: str) -> torch.Tensor | None:
        """The whole weight ``name``, gathered from every rank."""
        self.workers.send("full_weight", {"name": name})
        return super().full_weight(name)

    def capture_graphs(self) -> None:
        """Capture every rank's decode graphs together (each holds the all-reduces)."""
        if self.graph_sizes:
            self.workers.send("capture_graphs", {})
        super().capture_graphs()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every rank's pool (its KV heads' share)."""
        self.workers.send("allocate_kv_cache", {"num_blocks": num_blocks})
        super().allocate_kv_cache(num_blocks)

    def free_kv_cache(self) -> None:
        """Free every rank's pool."""
        self.workers.send("free_kv_cache", {})
        super().free_kv_cache()

    def offload_weights(self) -> None:
        """Move every rank's weights to CPU memory."""
        self.workers.send("offload_weights", {})
        super().offload_weights()

    def discard_weights(self) -> None:
        """Release every rank's weights without keeping them (``sleep(2)``)."""
        self.workers.send("discard_weights", {})
        super().discard_weights()

    def reload_weights(self) -> None:
        """Move every rank's weights back to its device."""
        self.workers.send("reload_weights", {})
        super().reload_weights()

    def close(self) -> None:
        """Shut the workers down now (else at collection or exit)."""
        self.workers.close()
