"""The training configuration: dataclasses that a recipe YAML and the command line fill.

One ``TrainConfig`` holds a section per concern (``rollout``, ``optim``, ``grpo``, ``ppo``,
``lora``, ``logging``). ``load_config`` reads a YAML file, applies ``section.field=value``
overrides from the command line, and rejects unknown fields with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandem.kernels import check_kv_cache_dtype
from tandem.kernels.quantization import QUANTIZATIONS
from tandem.rollout.config import EngineConfig

from .exact_conflicts import exact_conflicts
from .loss_config import (
    IMPORTANCE_SAMPLING_MODES,
    GRPOLossConfig,
    ImportanceSamplingConfig,
    PPOConfig,
    check_importance_sampling,
)


@dataclass(slots=True)
class RewardFunctionConfig:
    """One reward function and its weight in the total reward (an entry of ``rewards``).

    Attributes:
        name: a reward of the task (``correct``, ``format``...) or ``module:function``.
        weight: its factor in the weighted sum.
    """

    name: str
    weight: float = 1.0


@dataclass(slots=True)
class DynamicSamplingConfig:
    """Dynamic sampling (DAPO's; verl's ``filter_groups``): the recipe's
    ``rollout.dynamic_sampling`` section.

    Attributes:
        enabled: admit more prompts until ``prompts_per_step`` groups whose rewards spread
            (non-zero advantages) are complete.
        zero_spread: ``"drop"`` (train on the spread groups only) or ``"keep"`` (train on
            every group sampled).
        max_extra_prompts: the most prompts admitted per step beyond ``prompts_per_step``;
            once reached the step trains on what it has (``drop`` tops the batch up with
            zero-spread groups), logged as ``dynamic_sampling_cap_reached``.
    """

    enabled: bool = False
    zero_spread: str = "drop"
    max_extra_prompts: int = 16


@dataclass(slots=True)
class PartialRolloutConfig:
    """Partial rollouts (slime's APRIL, AReaL): the recipe's ``rollout.partial`` section.

    Attributes:
        enabled: over-provision groups and train as soon as ``prompts_per_step`` are
            complete; the unfinished ones stay in the engine, paused with their KV, through
            the weight update, and go on in the next step.
        over_provision: groups kept in flight beyond ``prompts_per_step``.
        carried_kv: after an update, ``keep`` (decode on from the KV of older weights; the
            importance weights correct the tokens) or ``recompute`` (re-prefill under the new
            weights, through the prefix cache keyed by version). ``sleep_between_steps``
            frees the KV, so it implies ``recompute``.
        max_staleness: a group whose oldest token is more than this many weight versions
            old at the start of a step is restarted from its prompt.
    """

    enabled: bool = False
    over_provision: int = 4
    carried_kv: str = "keep"
    max_staleness: int = 1


@dataclass(slots=True)
class RolloutConfig:
    """What the engine samples each step.

    Attributes:
        prompts_per_step: prompts per optimizer step (over all ranks).
        num_generations: completions per prompt (the GRPO group size).
        max_tokens: most tokens per completion.
        temperature: sampling temperature (the trainer scales its logits by it too).
        top_p: nucleus sampling; below 1 the engine returns each token's kept-set threshold
            and the trainer's log-probs are of the same truncated distribution.
        top_k: keep the k most likely tokens (0: all); replayed as ``top_p`` is.
        engine: keyword arguments of ``LLM`` (memory, block size, max_num_seqs, the KV
            pool's ``kv_cache_dtype``: ``fp8`` holds twice bfloat16's tokens and stays exact,
            the trainer's K and V rounded through it...).
        sleep_between_steps: free the engine's KV pool while the trainer steps.
        sleep_level: what else sleeps then, as vLLM's levels: 0 the KV pool alone
            (``release_kv_cache_memory``), 1 also the weights, moved to CPU, 2 the weights
            discarded (full fine-tuning: the weight update after the step brings them back,
            with no copy to the host and back).
        max_turns: for a task with an environment, most model turns per episode
            (``max_tokens`` is then per turn).
        max_total_tokens: for a task with an environment, most tokens per episode (default
            the engine's max_model_len).
        dynamic_sampling: admit prompts in place of groups whose rewards do not spread.
        partial: carry unfinished groups across steps instead of waiting for them.
        structured_outputs: ``StructuredOutputsParams`` fields (e.g. ``{json: <schema>}``)
            constraining every completion; the trainer replays the grammar's masks, so its
            log-probs are of the same constrained distribution. Single-turn tasks only.
        quantization: the engine samples with 8-bit weights (``"int8"`` or ``"fp8"``; the
            engine's ``quantization``), quantized from the trainer's weights at every sync.
            With exact log-probs the trainer's forward quantizes alike (straight-through
            gradient) and stays on-policy bit for bit; without, the importance-sampling
            correction (``importance_sampling``, truncated by default) weighs the gap, and
            the step logs it (``sampler_logprob_diff_*``, ``is_ratio_*``, ``behaviour_kl_*``).
            None: the model's dtype.
    """

    prompts_per_step: int = 8
    num_generations: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    sleep_between_steps: bool = False
    sleep_level: int = 0
    max_turns: int = 4
    max_total_tokens: int | None = None
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    structured_outputs: dict[str, Any] | None = None
    quantization: str | None = None


@dataclass(slots=True)
class OptimConfig:
    """The optimizer (AdamW) and its schedule.

    Attributes:
        lr: peak learning rate.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's betas.
        max_grad_norm: clip the gradient norm to this (0 disables).
        warmup_steps: linear warm-up steps before the constant rate.
        micro_batch_size: sequences per forward/backward (gradient accumulation splits a
            step's batch into micro-batches).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    micro_batch_size: int = 16


@dataclass(slots=True)
class LoraAdapterConfig:
    """A peft LoRA adapter on the policy (the recipe's ``lora`` section, from which peft's
    ``LoraConfig`` is built); only its tensors are trained and synced.

    Attributes:
        enabled: train an adapter instead of every weight.
        r: rank.
        lora_alpha: scale numerator.
        target_modules: the linear layers that get an adapter; empty (the default): the
            model family's own list (``lora_targets``: for Llama-family models every
            projection, q/k/v/o and gate/up/down).
        sync_mode: ``"merge"`` (the engine merges into its weights) or ``"runtime"``.
    """

    enabled: bool = False
    r: int = 16
    lora_alpha: float = 32.0
    target_modules: list[str] = field(default_factory=list)
    sync_mode: str = "merge"


@dataclass(slots=True)
class MoeConfig:
    """Mixture-of-experts policies (the recipe's ``moe`` section).

    Attributes:
        routing_replay: the trainer's forward passes route each token to the experts the
            sampler chose (rollout routing replay), each weighted by the trainer's own router
            probability, renormalised as the family does. Either way the step logs
            ``routing_agreement``, the fraction of token-layer choices where the trainer's
            own top-k set equals the sampler's.
    """

    routing_replay: bool = False


@dataclass(slots=True)
class LoggingConfig:
    """Where metrics go.

    Attributes:
        wandb: log to Weights & Biases (rank 0 only; offline unless ``WANDB_MODE`` or
            ``wandb_mode`` says online).
        wandb_project: the W&B project.
        wandb_mode: ``"offline"`` (default) or ``"online"``; ``WANDB_MODE`` wins when set.
        jsonl: write one JSON line of metrics per step to ``output_dir/metrics.jsonl``.
        console_every: print a metrics line every this many steps (0: never).
        progress_bar: show a tqdm bar over steps.
    """

    wandb: bool = True
    wandb_project: str = "tandem"
    wandb_mode: str = "offline"
    jsonl: bool = True
    console_every: int = 1
    progress_bar: bool = True


@dataclass(slots=True)
class TrainConfig:
    """A whole training run (a recipe).

    Attributes:
        algorithm: ``"grpo"`` or ``"ppo"``.
        model: a local Hugging Face folder or ``smollm2-135m-instruct``.
        dtype: the trainer's weights' dtype (and the engine's unless ``rollout.engine``
            names one).
        autocast: run the trainer's forward passes under ``torch.autocast`` in this dtype
            (``"bfloat16"`` on a GPU keeps float32 master weights); None: no autocast.
        task: the dataset and its rewards (``arith``, ``calculator``, ``dataset``, ``gsm8k``,
            ``target_token``: see trainers/tasks.py).
        task_args: keyword arguments of the task.
        rewards: the reward functions and weights (default: the task's).
        steps: optimizer steps.
        seed: seeds data order, sampling and initialisation.
        output_dir: checkpoints and logs.
        checkpoint_every: save every this many steps (0: only at the end).
        checkpoint_keep: keep only the newest this many checkpoints (0: all).
        resume_from: a checkpoint folder to continue from, or ``latest``: the newest
            complete checkpoint of ``output_dir`` (a fresh start when there is none).
        eval_size: held-out prompts evaluated greedily before and after training (0: none).
        eval_reward: the reward whose mean on the held-out prompts is reported as accuracy.
        sync_alias: let the engine serve the trainer's tensors instead of copies (same
            device and dtype only; saves the copy and its memory).
        exact_logprobs: the trainer's forward passes run through the engine's
            batch-invariant kernels, so its log-probs of the sampled tokens equal the
            engine's bit for bit (``sampler_logprob_diff_max == 0``; see
            ``rollout/exact_forward.py``). None (default): on wherever it can be (the engine
            on CPU in the trainer's dtype, without ``autocast``, ``sync_alias``, FSDP2 or
            tensor parallelism); true: refuse to start where it cannot; false: off (the
            trainer's forward through transformers).
        shared_prefix: the exact forward computes each row's longest common prefix with
            the row before (a group's prompt, a multi-turn group's earlier turns) once, and
            micro-batches keep whole groups, packed by that cost (``rollout/worker/
            shared_prefix.py``, ``micro_batches.py``): the same log-probs and loss bit for
            bit, the gradients within float rounding. Needs the exact forward; without it
            the run says why at start and computes every row whole. False: every row whole,
            micro-batches of ``optim.micro_batch_size`` rows (the reference).
        distributed: ``"ddp"`` or ``"fsdp2"`` under torchrun.
        importance_sampling: the off-policy correction of the loss (both algorithms).
    """

    algorithm: str = "grpo"
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    autocast: str | None = None
    task: str = "arith"
    task_args: dict[str, Any] = field(default_factory=dict)
    rewards: list[RewardFunctionConfig] = field(default_factory=list)
    steps: int = 20
    seed: int = 0
    output_dir: str = "runs/tandem"
    checkpoint_every: int = 0
    checkpoint_keep: int = 0
    resume_from: str | None = None
    eval_size: int = 0
    eval_reward: str | None = None
    sync_alias: bool = False
    exact_logprobs: bool | None = None
    shared_prefix: bool = True
    distributed: str = "ddp"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    importance_sampling: ImportanceSamplingConfig = field(
        default_factory=ImportanceSamplingConfig)
    lora: LoraAdapterConfig = field(default_factory=LoraAdapterConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _one_of("algorithm", self.algorithm, ("grpo", "ppo"))
        _one_of("distributed", self.distributed, ("ddp", "fsdp2"))
        _one_of("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.autocast is not None:
            _one_of("autocast", self.autocast, ("bfloat16", "float16"))
        _one_of("grpo.loss_type", self.grpo.loss_type, ("grpo", "dr_grpo", "token"))
        _one_of("lora.sync_mode", self.lora.sync_mode, ("merge", "runtime"))
        _one_of("logging.wandb_mode", self.logging.wandb_mode, ("offline", "online"))
        _one_of("importance_sampling.mode", self.importance_sampling.mode,
                IMPORTANCE_SAMPLING_MODES)
        check_importance_sampling(self.importance_sampling)
        _check_partial(self.rollout.partial, self.sync_alias)
        _check_quantization(self.rollout, self.sync_alias)
        if self.sync_alias and self.rollout.engine.get("tensor_parallel_size", 1) > 1:
            raise ValueError("sync_alias with rollout.engine.tensor_parallel_size > 1: each rank "
                             "holds a slice, which cannot alias the trainer's full tensors; "
                             "turn sync_alias off.")
        _one_of("rollout.dynamic_sampling.zero_spread", self.rollout.dynamic_sampling.zero_spread,
                ("drop", "keep"))
        self._check_sleep_level()
        for name in ("steps", "rollout.prompts_per_step", "rollout.num_generations",
                     "rollout.max_tokens", "optim.micro_batch_size",
                     "rollout.dynamic_sampling.max_extra_prompts"):
            _at_least(name, _get(self, name), 1)
        for name in ("checkpoint_every", "checkpoint_keep", "eval_size", "optim.warmup_steps"):
            _at_least(name, _get(self, name), 0)
        if self.algorithm == "grpo" and self.rollout.num_generations < 2:
            raise ValueError("rollout.num_generations must be >= 2 for GRPO: advantages are "
                             "relative to the other completions of the same prompt.")
        if self.rollout.dynamic_sampling.enabled and self.algorithm != "grpo":
            raise ValueError("rollout.dynamic_sampling is for GRPO (a group whose rewards do "
                             "not spread has zero advantages there): turn it off for "
                             f"algorithm={self.algorithm!r}.")
        engine_fields = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
        unknown = sorted(set(self.rollout.engine) - set(engine_fields))
        if unknown:
            raise ValueError(f"unknown engine option(s) rollout.engine.{', '.join(unknown)}"
                             f"{_nearest(unknown, list(engine_fields), 'rollout.engine.')}: "
                             f"valid options are {', '.join(engine_fields)}.")
        check_kv_cache_dtype(self.rollout.engine.get("kv_cache_dtype", "auto"))
        conflicts = exact_conflicts(self)
        if self.exact_logprobs and conflicts:
            raise ValueError(f"exact_logprobs: true cannot hold with {', '.join(conflicts)}: "
                             "change those, or set exact_logprobs: false.")
        if not self.optim.lr > 0:
            raise ValueError(f"optim.lr={self.optim.lr!r} is invalid: it must be > 0.")

    def _check_sleep_level(self) -> None:
        level = self.rollout.sleep_level
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level={level!r} is invalid: use 0 (the KV pool "
                             "alone), 1 (the weights to CPU too) or 2 (the weights discarded).")
        if level and not self.rollout.sleep_between_steps:
            raise ValueError(f"rollout.sleep_level={level} needs rollout.sleep_between_steps: "
                             "true (the engine sleeps only then).")
        if level == 2 and self.lora.enabled:
            raise ValueError("rollout.sleep_level=2 discards the engine's weights, and a LoRA "
                             "update brings back only the adapted ones: use sleep_level 0 or "
                             "1 with lora.")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """A ``TrainConfig`` from a YAML recipe plus ``section.field=value`` overrides.

    Override values are parsed as YAML (``steps=5``, ``lora.enabled=true``,
    ``rollout.engine={num_kv_blocks: 64}``).

    Raises:
        ValueError: for an unknown field (naming the valid ones), a malformed override or an
            invalid value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a recipe is a YAML mapping of TrainConfig fields.")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override {override!r} is malformed: write section.field=value.")
        _set_dotted(data, key.strip(), yaml.safe_load(value))
    return from_dict(TrainConfig, data)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data (what a recipe YAML holds)."""
    return dataclasses.asdict(config)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, recursing into nested dataclass fields.

    Raises:
        ValueError: for a key that is not a field of ``cls``, naming the valid ones.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(prefix + k for k in unknown)}"
                         f"{_nearest(unknown, list(fields), prefix)}: valid fields are "
                         f"{', '.join(prefix + k for k in fields)} (tandem train --list-keys "
                         "lists every key with its help).")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _field_value(hints[name], value, prefix + name)
              for name, value in data.items()}
    return cls(**kwargs)


def _field_value(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return [from_dict(args[0], {"name": item} if isinstance(item, str) else item,
                          f"{name}[{i}].") for i, item in enumerate(value)]
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    accepts_float = hint is float or (origin in (typing.Union, types.UnionType)
                                      and float in args)
    if accepts_float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML 1.1 reads ``1e-5`` (no dot) as a string
        except ValueError:
            raise ValueError(f"{name}={value!r} is invalid: it must be a number.") from None
    return value


def _nearest(unknown: list[str], valid: list[str], prefix: str) -> str:
    """`` (did you mean X?)`` for each unknown key with a close valid one, else ``""``."""
    close = [f"{prefix}{match[0]}" for key in unknown
             if (match := difflib.get_close_matches(key, valid, n=1, cutoff=0.6))]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise ValueError(f"override {key!r}: {section!r} is not a section.")
    data[last] = value


def _check_partial(config: PartialRolloutConfig, sync_alias: bool) -> None:
    _one_of("rollout.partial.carried_kv", config.carried_kv, ("keep", "recompute"))
    _at_least("rollout.partial.max_staleness", config.max_staleness, 0)
    _at_least("rollout.partial.over_provision", config.over_provision, 1)
    if config.enabled and sync_alias:
        raise ValueError("rollout.partial with sync_alias=true: an aliased engine serves the "
                         "trainer's tensors as they change, so paused sequences cannot keep "
                         "older weights; turn one of them off.")


def _check_quantization(rollout: RolloutConfig, sync_alias: bool) -> None:
    if "quantization" in rollout.engine:
        raise ValueError("rollout.engine.quantization: set rollout.quantization instead (the "
                         "trainer reads it too).")
    if rollout.quantization is None:
        return
    _one_of("rollout.quantization", rollout.quantization, QUANTIZATIONS)
    if sync_alias:
        raise ValueError("sync_alias with rollout.quantization: the engine holds 8-bit copies "
                         "of the weights, not the trainer's tensors; turn sync_alias off.")


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is invalid: use one of {', '.join(valid)}.")


def _at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}.")
