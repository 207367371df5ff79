"""Hugging Face TRL's ``GRPOTrainer`` generating with a colocated Tandem engine.

The seam is TRL's own vLLM path. ``GRPOTrainer`` with ``use_vllm=True`` builds a
``VLLMGeneration`` and, once per generation round, calls its ``sync_weights()`` (only when
``global_step`` moved since the last sync, so never per micro-batch) and its ``generate(...)``
(token ids in; completion ids and the sampled tokens' processed log-probs out).
``TandemGeneration`` is a ``VLLMGeneration`` whose engine is Tandem's ``LLM``;
``tandem_grpo_trainer`` builds the trainer with it in vLLM's place. Everything else stays
TRL's: tokenization and chat templates, reward functions, the multi-turn tool loop, the
importance-sampling correction (``vllm_importance_sampling_correction``, fed by the engine's
processed log-probs) and its ``sampling/...`` and ``profiling/...`` metrics. Tandem adds its
engine's metrics as ``tandem/...`` keys in TRL's logs.

Supported: TRL ``TRL_SUPPORTED``, ``vllm_mode="colocate"`` with one device per process
(single process or DDP; FSDP and DeepSpeed ZeRO-3 gather through TRL's own iterator), full
fine-tuning (all weights pushed) and peft LoRA (only the adapter pushed, merged by the engine
from its kept base weights, or added at run time), ``vllm_enable_sleep_mode`` (the KV pool is
freed from the end of a round to the start of the next). Refused with a ``ValueError``: other
TRL versions, ``vllm_mode="server"``, tensor parallelism, structured outputs, images, and
``generation_kwargs`` that Tandem's ``SamplingParams`` does not know.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import trl
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.default_model import resolve_model
from tandem.sync import LoraSync, peft_adapter_state

from .generation import engine_round_metrics, timed_sleep, timed_wake

TRL_SUPPORTED = ">=1.16,<1.17"


def check_trl_version(version: str) -> None:
    """Refuse a TRL version outside ``TRL_SUPPORTED``.

    Raises:
        ValueError: naming the installed version, the supported range and the fix.
    """
    if Version(version) not in SpecifierSet(TRL_SUPPORTED):
        raise ValueError(f"trl {version} is installed, but Tandem's TRL drop-in supports trl"
                         f"{TRL_SUPPORTED} (it replaces TRL's vLLM generation, whose internals "
                         f"change between releases): pip install 'trl{TRL_SUPPORTED}' "
                         "(or tandem-rollout[trl]).")


# TRL's internals below are version specific: check before importing them.
check_trl_version(trl.__version__)

from accelerate.utils import is_peft_model  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402
from trl.trainer import grpo_trainer  # noqa: E402

# (GRPOConfig field, the value Tandem supports, why and what to do instead)
REQUIRED_SETTINGS = (
    ("vllm_mode", "colocate", "Tandem generates inside each training process; for a separate "
     "server run `tandem serve --enable-control-routes --enable-weight-transfer "
     "--control-api-key KEY` and drive it with TandemClient(url, api_key, "
     "control_api_key=KEY) in a rollout_func"),
    ("vllm_tensor_parallel_size", 1, "each process runs one Tandem engine on its own device"),
)
# Set by TRL itself from its own config fields, so not accepted in generation_kwargs.
OWN_SAMPLING_FIELDS = ("n", "logprobs")


@dataclass(slots=True)
class TandemConfig:
    """How Tandem generates for a TRL trainer.

    Attributes:
        model: the local Hugging Face folder the engine starts from (architecture, tokenizer,
            initial weights; the trainer's weights are pushed before the first round).
            None: the trained model's ``name_or_path`` (a folder, the embedded default, or a
            Hub id already in the local Hugging Face cache).
        engine: further keyword arguments of ``LLM`` (``num_kv_blocks``, ``block_size``,
            ``kv_cache_memory_bytes``, ``dtype``, ``seed``, ...). TRL's own settings fill
            ``device``, ``max_model_len``, ``max_num_seqs``, ``gpu_memory_utilization`` (on
            CUDA) and ``seed`` (the process index, as TRL seeds vLLM) unless given here.
        lora_sync_mode: for a peft model, ``"merge"`` (the engine merges the pushed adapter
            into its weights) or ``"runtime"`` (the engine adds the adapter in each layer).

    Raises:
        ValueError: for an unknown ``lora_sync_mode`` or an ``engine`` key that TRL sets
            from its own config.
    """

    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    lora_sync_mode: str = "merge"

    def __post_init__(self) -> None:
        if self.lora_sync_mode not in ("merge", "runtime"):
            raise ValueError(f"TandemConfig.lora_sync_mode={self.lora_sync_mode!r} is invalid: "
                             "use 'merge' or 'runtime'.")
        if "model" in self.engine:
            raise ValueError("TandemConfig.engine['model'] is invalid: give the folder as "
                             "TandemConfig.model.")


def check_grpo_config(args: GRPOConfig) -> None:
    """Refuse TRL settings Tandem cannot honour, before the trainer is built.

    Raises:
        ValueError: naming the field, its value and what to do instead.
    """
    for name, supported, why in REQUIRED_SETTINGS:
        value = getattr(args, name)
        if value != supported:
            raise ValueError(f"GRPOConfig.{name}={value!r} is not supported with Tandem ({why}): "
                             f"set {name}={supported!r}.")
    sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    given = set(args.generation_kwargs or {})
    unknown = (given - sampling_fields) | (given & set(OWN_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"GRPOConfig.generation_kwargs has {sorted(unknown)}, which Tandem's "
                         "SamplingParams does not take from there: remove them (TRL sets n and "
                         f"logprobs itself; Tandem knows {sorted(sampling_fields)}).")


class TandemGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` with a colocated Tandem ``LLM`` as its engine.

    TRL constructs it with ``VLLMGeneration``'s arguments (its sampling settings, memory
    share, ``max_num_seqs``, ``enable_sleep_mode``...); ``tandem`` says the rest. Weights
    are gathered by TRL's own iterator (DDP, FSDP, ZeRO-3, peft merged); a peft model on
    one device pushes only its adapter through ``LoraSync``.

    Attributes:
        llm: the engine.
        lora_sync: the adapter pusher for a peft model (None: full updates).
        metrics: TRL's ``trainer._metrics`` (``{"train"|"eval": {key: [values]}}``), where
            the ``tandem/...`` keys go; None records nothing.
    """

    def __init__(self, *args: Any, tandem: TandemConfig, **kwargs: Any) -> None:
        self.tandem = tandem
        self.metrics: dict[str, defaultdict[str, list[float]]] | None = None
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        """Start the engine (TRL's constructor calls this in place of starting vLLM)."""
        if self.logprobs not in (0, None):
            raise ValueError(f"logprobs={self.logprobs} is not supported with Tandem: TRL's "
                             "GRPO asks for 0 (the sampled token's log-prob).")
        self.sampling_params = self._sampling_params()
        self.llm = LLM(str(self._model_folder()), **self._engine_args())
        # TRL's tool loop reads the context limit where vLLM keeps it.
        self.llm.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=self.llm.max_model_len))
        sharded = self._dist.is_fsdp or self._dist.is_zero3
        self.lora_sync = (LoraSync(self.llm, mode=self.tandem.lora_sync_mode)
                          if is_peft_model(self.model) and not sharded else None)
        if self.enable_sleep_mode:
            self.llm.release_kv_cache_memory()
        self.accelerator.wait_for_everyone()

    def _sampling_params(self) -> SamplingParams:
        # TRL scores its completions without the grammar's mask: under structured outputs
        # its importance ratio is biased, as under truncation (the native trainer replays it).
        regex = self.structured_outputs_regex
        return SamplingParams(**{
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p or 0.0, "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_completion_length, "logprobs": 0,
            **self.generation_kwargs,
            **({} if regex is None else {"structured_outputs": {"regex": regex}})})

    def _model_folder(self) -> str:
        name = self.tandem.model or self.model.name_or_path
        try:
            return str(resolve_model(name))
        except ValueError:
            return _cached_hub_folder(name)

    def _engine_args(self) -> dict[str, Any]:
        device = self.accelerator.device
        defaults: dict[str, Any] = {"device": str(device), "max_model_len": self.max_model_length,
                                    "seed": self.accelerator.process_index}
        if self.max_num_seqs is not None:
            defaults["max_num_seqs"] = self.max_num_seqs
        if device.type == "cuda":
            defaults["gpu_memory_utilization"] = self.gpu_memory_utilization
        return defaults | self.tandem.engine

    def sync_weights(self) -> None:
        """Push the trainer's weights (or a peft model's adapter) into the engine, bumping its
        weight version; TRL calls this at most once per optimizer step."""
        start = time.perf_counter()
        if self.lora_sync is not None:
            self.lora_sync.update(*peft_adapter_state(self.model))
        else:
            self.llm.update_weights(self._iter_named_params())
        self._record({"sync_seconds": time.perf_counter() - start})

    def generate(self, prompts: list[list[int]], images: list[Any] | None,
                 num_generations: int, profiler: Any = None) -> tuple[list, list, list, list]:
        """Sample one completion per prompt (TRL repeats each prompt ``num_generations``
        times; a run of equal prompts becomes one request of ``n`` completions, which share
        its prompt's KV blocks).

        Returns:
            ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` as
            ``VLLMGeneration.generate``: per completion, its prompt, its tokens (ending with
            EOS when it stopped), and per token ``[processed log-prob]`` and ``[token id]``.

        Raises:
            ValueError: for images (Tandem serves text-only models).
        """
        if images is not None and any(image is not None for image in images):
            raise ValueError("images are not supported with Tandem: it serves text-only models.")
        self._wake()
        requests = equal_prompt_runs(prompts)
        params = [dataclasses.replace(self.sampling_params, n=count) for _, count in requests]
        before = self.llm.stats()
        start = time.perf_counter()
        with profiler or nullcontext():
            outputs = self.llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        completions = [completion for output in outputs for completion in output.outputs]
        self._record(round_metrics(before, self.llm.stats(), completions, seconds))
        self._sleep()
        return ([list(ids) for ids, count in requests for _ in range(count)],
                [list(c.token_ids) for c in completions],
                [[[logprob] for logprob in c.logprobs] for c in completions],
                [[[token] for token in c.token_ids] for c in completions])

    def _wake(self) -> None:
        seconds = timed_wake(self.llm)
        if seconds is not None:
            self._record({"wake_seconds": seconds})

    def _sleep(self) -> None:
        if self.enable_sleep_mode:
            self._record({"sleep_seconds": timed_sleep(self.llm)})

    def _record(self, values: dict[str, float]) -> None:
        if self.metrics is None:
            return
        mode = "train" if self.model.training else "eval"
        for key, value in values.items():
            self.metrics[mode][f"tandem/{key}"].append(float(value))


def equal_prompt_runs(prompts: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive equal prompts as ``(prompt, count)`` pairs, in order."""
    runs: list[tuple[list[int], int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((list(prompt), 1))
    return runs


def round_metrics(before: dict[str, float], after: dict[str, float],
                  completions: Sequence[Any], seconds: float) -> dict[str, float]:
    """A generation round's engine metrics (``engine_round_metrics``) and its tokens/s."""
    tokens = sum(len(completion.token_ids) for completion in completions)
    return {**engine_round_metrics(before, after),
            "generation_tokens_per_second": tokens / max(seconds, 1e-9)}


def _cached_hub_folder(name: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except Exception as error:
        raise ValueError(f"Tandem cannot find the model {name!r} locally: it loads a local "
                         "Hugging Face folder, the embedded default, or a Hub id already in the "
                         "local cache; pass TandemConfig(model=FOLDER).") from error


def tandem_grpo_trainer(*args: Any, tandem: TandemConfig | None = None,
                        trainer_class: type[GRPOTrainer] = GRPOTrainer,
                        **kwargs: Any) -> GRPOTrainer:
    """Build TRL's ``GRPOTrainer`` (or a subclass) generating with Tandem: the one-line switch.

    Takes ``GRPOTrainer``'s arguments unchanged; ``args.use_vllm`` is turned on (the
    trainer's vLLM path, with Tandem as its engine) and the ``vllm_*`` settings keep their
    meaning. The trainer's class is untouched, so its ``profiling/...`` keys are TRL's.

    Raises:
        ValueError: for an unsupported TRL version or setting (see ``check_grpo_config``).
    """
    check_trl_version(trl.__version__)
    bound = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs)
    config = bound.arguments.get("args") or _default_config(bound.arguments["model"])
    check_grpo_config(config)
    config.use_vllm = True
    bound.arguments["args"] = config
    tandem = tandem or TandemConfig()

    def generation(*gen_args: Any, **gen_kwargs: Any) -> TandemGeneration:
        return TandemGeneration(*gen_args, tandem=tandem, **gen_kwargs)

    # Only the trainer's constructor sees the swap, and it ends with the constructor.
    with mock.patch.object(grpo_trainer, "VLLMGeneration", generation):
        trainer = trainer_class(*bound.args[1:], **bound.kwargs)
    trainer.vllm_generation.metrics = trainer._metrics
    return trainer


def _default_config(model: Any) -> GRPOConfig:
    """The config ``GRPOTrainer`` makes when given none."""
    name = model if isinstance(model, str) else model.config._name_or_path
    return GRPOConfig(f"{name.split('/')[-1]}-GRPO")


__all__ = ["TRL_SUPPORTED", "TandemConfig", "TandemGeneration", "check_grpo_config",
           "check_trl_version", "tandem_grpo_trainer"]
