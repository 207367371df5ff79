"""Engine configuration: one dataclass, validated when built (``EngineConfig``), and the
part of it a worker's runner takes, resolved (``WorkerConfig``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tandem.kernels import (
    batch_invariance_gap,
    check_backend,
    check_kv_cache_dtype,
    kv_cache_dtype,
)
from tandem.kernels.quantization import check_quantization

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "half": torch.float16, "float": torch.float32}


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start, with vLLM's names and meanings.

    Each field's help is in its metadata (``metadata["help"]``), which ``tandem serve
    --help`` prints.
    """

    model: str = field(metadata={"help": "a local Hugging Face folder, or "
                                 "``smollm2-135m-instruct`` (the embedded default)."})
    dtype: str | torch.dtype = field(default="auto", metadata={"help": (
        "``\"auto\"`` (float32 on CPU, the checkpoint's dtype on GPU), a name such as "
        "``\"bfloat16\"``, or a ``torch.dtype``.")})
    device: str | None = field(default=None, metadata={"help": (
        "``\"cpu\"``, ``\"cuda\"``, ``\"cuda:1\"``...; None picks CUDA when available.")})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block."})
    num_kv_blocks: int | None = field(default=None, metadata={"help": (
        "the KV pool's size in blocks (overrides the two below).")})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={"help": (
        "the KV pool's size in bytes.")})
    kv_cache_dtype: str = field(default="auto", metadata={"help": (
        "the KV pool's element type (vLLM's --kv-cache-dtype): ``\"auto\"`` (the model's "
        "dtype) or ``\"fp8\"`` (also ``\"fp8_e4m3\"``): float8_e4m3fn, one byte an element, "
        "so the same pool bytes hold twice bfloat16's tokens and four times float32's. K and "
        "V are stored divided by a scale per layer and KV head, clamped to +-448 (beyond "
        "saturates, never NaN) and rounded. The scales are 1.0, vLLM's default without "
        "calibrated scales, and never change: calibrating them on the first prefill would "
        "make every token's KV depend on which request came first (another order of "
        "requests, a restart or a resumed run would store other bits). On CUDA it needs "
        "compute capability 8.9 or newer (Ada, Hopper).")})
    gpu_memory_utilization: float | None = field(default=None, metadata={"help": (
        "the fraction of device memory this engine owns in all (weights, KV pool, buffers); "
        "the KV pool gets what the rest leaves. Default 0.9 on CUDA. On CPU the pool defaults "
        "to 1 GiB.")})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step."})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": (
        "most tokens computed in one step (the chunked-prefill budget). Default, as vLLM's: "
        "8192 on GPU and 4096 on CPU; under ``tandem serve`` on CPU 1024 (vLLM's 2048), "
        "where a long prompt's prefill would otherwise hold back the running streams and "
        "other first tokens.")})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest sequence (prompt plus completion); default the model's.")})
    enable_prefix_caching: bool = field(default=True, metadata={"help": (
        "reuse the KV of repeated prompt prefixes.")})
    seed: int = field(default=0, metadata={"help": (
        "seed of the generator for requests without their own seed.")})
    attention_backend: str = field(default="auto", metadata={"help": (
        "the kernels: ``\"auto\"`` (Triton on CUDA; on CPU ``\"cpu\"`` where a C compiler "
        "builds its kernels, else torch), ``\"triton\"`` (on CPU only under the Triton "
        "interpreter, ``TRITON_INTERPRET=1``), ``\"cpu\"`` (decode attention and the layer "
        "operations compiled in C, torch for the rest) or ``\"torch\"`` (the plain-torch "
        "references).")})
    enforce_eager: bool = field(default=False, metadata={"help": (
        "never capture CUDA graphs (they are captured on CUDA with the Triton kernels "
        "otherwise).")})
    async_scheduling: bool | None = field(default=None, metadata={"help": (
        "overlap the host and the device (vLLM's --async-scheduling): the host schedules "
        "and prepares the next step while the device runs this one, and learns the sampled "
        "tokens a step late (see ``step_overlap.py``). Default (None): on for CUDA, off on "
        "CPU, whose steps do not run apart from the host. Seeded sampling gives the same "
        "tokens either way.")})
    exact_logprobs: bool | None = field(default=None, metadata={"help": (
        "batch-invariant kernels, whose bits a trainer's forward pass reproduces: a token's "
        "log-prob does not depend on the batch, the chunk or the cache around it, and a "
        "trainer scoring it through ``rollout/exact_forward.py`` gets it bit for bit. On CPU "
        "every linear layer multiplies through the panels (no timed layout choice) and "
        "every query runs the decode order; on CUDA (Triton) every linear layer multiplies "
        "through a fixed-tile matmul and every query through the prefill kernel. Default "
        "(None): on for CPU where the C kernels build, in float32 or bfloat16; off on CUDA "
        "(opt in with True) until the GPU check measures its cost. Alias updates need it off "
        "on CPU.")})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "ranks one model is split over (vLLM's --tensor-parallel-size): each holds its share "
        "of the heads, the MLP, the vocabulary and the KV pool (a KV budget is per rank). "
        "The engine starts size - 1 worker processes (on CPU each gets cores / size "
        "threads).")})
    distributed_executor_backend: str = field(default="mp", metadata={"help": (
        "with tensor_parallel_size > 1: \"mp\" starts worker processes; "
        "\"external_launcher\" (vLLM's name, as verl runs it) makes each process of an "
        "initialised torch.distributed world (torchrun) one rank of an engine, consecutive "
        "ranks forming each engine, every rank running the same requests in step.")})
    tune_cpu_allocator: bool = field(default=True, metadata={"help": (
        "on CPU, raise glibc malloc's mmap and trim thresholds for the whole process so that "
        "freed temporaries are reused instead of page-faulted in again every step (see "
        "``cpu_allocator.py``); False leaves malloc as it is.")})
    quantization: str | None = field(default=None, metadata={"help": (
        "8-bit weights for the decoder layers' projections (q/k/v/o, gate/up/down), one "
        "float32 scale per output channel, quantized at load and in every weight update "
        "(the trainer sends float weights): ``\"int8\"`` or ``\"fp8\"`` (e4m3; on CUDA "
        "compute capability 8.9 or newer). The embedding, LM head and norms keep the "
        "model's dtype. On CPU through the compiled panels (exact log-probs hold: the "
        "trainer's exact forward quantizes alike), on CUDA through a Triton matmul that "
        "converts the weights in registers. None (default): the model's dtype. Alias updates "
        "and mixtures of experts are refused with it.")})

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.torch_device.type == "cuda" else 4096
        _positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens",
                  "tensor_parallel_size")
        _positive_or_none(self, "num_kv_blocks", "kv_cache_memory_bytes", "max_model_len")
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={utilization} is invalid: it must be in "
                             "(0, 1].")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: use 'auto' or one of "
                             f"{', '.join(DTYPES)}.")
        check_backend(self.attention_backend)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_quantization(self.quantization)
        if self.distributed_executor_backend not in ("mp", "external_launcher"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}"
                             " is invalid: use 'mp' or 'external_launcher'.")

    @property
    def torch_device(self) -> torch.device:
        """The device to run on (CUDA when available and none was named)."""
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def overlaps_steps(self) -> bool:
        """Whether steps overlap (``async_scheduling``, by default on CUDA)."""
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

    def exact(self, dtype: torch.dtype, model_invariant: bool = True) -> bool:
        """Whether the engine runs the batch-invariant kernels (``exact_logprobs``) in
        ``dtype``, the model's, for a model family whose layers support them
        (``model_invariant``; ``CausalLM.batch_invariant``).

        Raises:
            ValueError: when ``exact_logprobs=True`` asks for them where they do not run.
        """
        reason = _inexact_reason(self, dtype) or (
            None if model_invariant else "is not built yet for this model family's layers "
            "(its batch_invariant is False)")
        if self.exact_logprobs and reason:
            raise ValueError(f"exact_logprobs=True {reason}; set exact_logprobs=False.")
        return bool(self.exact_logprobs is not False and not reason)

    def worker_config(self, model_dir: str, dtype: torch.dtype, max_model_len: int,
                      eos_token_ids: set[int], model_invariant: bool = True) -> WorkerConfig:
        """The runner's part of this config, resolved for a model folder, dtype and length
        (``model_invariant``: see ``exact``)."""
        return WorkerConfig(str(model_dir), str(dtype).removeprefix("torch."),
                            str(self.torch_device), max_model_len, self.block_size,
                            self.attention_backend, self.enforce_eager, self.max_num_seqs,
                            self.exact(dtype, model_invariant), self.seed,
                            tuple(sorted(eos_token_ids)), self.kv_cache_dtype,
                            self.quantization)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The model dtype: float32 on CPU for 'auto', else the checkpoint's (bfloat16 if unset)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        return checkpoint_dtype or torch.bfloat16


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a model runner needs, each option resolved (``EngineConfig.worker_config``):
    one object for the runner, and the tensor-parallel wire's message to a worker process
    (``as_json``/``from_json``)."""

    model_dir: str
    dtype: str  # a torch dtype's name: "float32", "bfloat16"...
    device: str
    max_model_len: int
    block_size: int = 16
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_num_seqs: int = 256
    exact_logprobs: bool = False
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    kv_cache_dtype: str = "auto"
    quantization: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element dtype (``kv_cache_dtype`` resolved on this device).

        Raises:
            ValueError: where an FP8 pool cannot run (``kernels.kv_cache_dtype``).
        """
        return kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype, self.torch_device)

    @property
    def torch_device(self) -> torch.device:
        """The device as a ``torch.device``."""
        return torch.device(self.device)

    def as_json(self) -> dict[str, Any]:
        """The fields as JSON values."""
        return {**asdict(self), "eos_token_ids": list(self.eos_token_ids)}

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> WorkerConfig:
        """The config ``as_json`` gave."""
        return cls(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})


def _inexact_reason(config: EngineConfig, dtype: torch.dtype) -> str | None:
    """Why the batch-invariant kernels cannot run for ``config`` in ``dtype`` (None: they
    can)."""
    return batch_invariance_gap(config.attention_backend, config.torch_device, dtype,
                                opted_in=bool(config.exact_logprobs))


def _positive(config: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1.")


def _positive_or_none(config: EngineConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) is not None:
            _positive(config, name)
