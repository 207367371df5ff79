"""The colocated RL loop: rollouts from the engine, rewards, one optimizer step, weight update.

Each step: the rank's share of the step's prompts goes to its engine (groups of
``num_generations``, with the sampled tokens' processed log-probs); the reward functions score
the completions; the algorithm (GRPO or PPO) turns them into a loss over micro-batches; the
optimizer steps; the new weights (all of them, or the LoRA adapter) go into the engine, whose
weight version advances. The engine may sleep (KV pool freed) from the end of the rollouts to
the start of the next ones.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.rollout import LLM
from tandem.rollout.config import DTYPES
from tandem.rollout.default_model import resolve_model
from tandem.rollout.worker.models import model_class

from .algorithms import GRPO, PPO, MicroBatch, combine_metrics
from .checkpoints import (
    load_trainer_state,
    prune_checkpoints,
    resolve_resume,
    save_policy,
    save_trainer_state,
    staged_folder,
)
from .config import RolloutConfig, TrainConfig, to_dict
from .data_parallel import (
    all_reduce_metrics,
    full_named_parameters,
    init_distributed,
    set_gradient_sync,
    wrap_policy,
)
from .exact_conflicts import exact_conflicts
from .generation import (
    RolloutBatch,
    engine_round_metrics,
    evaluation_rollout,
    generate_groups,
    make_collector,
    timed,
    timed_sleep,
    timed_wake,
)
from .groups import Group, rollout_params
from .logger import MetricsLogger
from .losses import masked_mean
from .micro_batches import group_slices, row_slices
from .policy import Policy, TokenBatch, ValueHead, pad_rows, sampling_replay, token_batch
from .rewards import WeightedReward, compute_rewards, resolve_reward
from .routing import RoutingCounts, routing_rows
from .tasks import Example, Task, build_task
from .tp_rollouts import engine_options, rollout_rank, rollout_slot, shared_rollouts


class Trainer:
    """Trains a policy with GRPO or PPO against its own colocated Tandem engine.

    Args:
        config: the run (see ``TrainConfig``).
        task: a task object instead of ``config.task`` (for rewards defined in code).

    Raises:
        ValueError: for a configuration that cannot run (unknown reward, prompts not divisible
            among ranks, LoRA with FSDP2...).
    """

    def __init__(self, config: TrainConfig, task: Task | None = None) -> None:
        self.config = config
        self.context = init_distributed(config.rollout.engine.get("device"))
        self.task = task or build_task(config.task, **config.task_args)
        self._check_layout()
        torch.manual_seed(config.seed)
        self.rewards = self._build_rewards()
        self.model_dir = resolve_model(config.model)
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.resume_path = resolve_resume(config.resume_from, self.output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.algorithm = (GRPO(config.grpo, config.importance_sampling)
                          if config.algorithm == "grpo"
                          else PPO(config.ppo, config.importance_sampling))
        self.policy = self._build_policy()
        self.reference = self._build_reference()
        self.model = wrap_policy(self.policy, self.context, config.distributed)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.optim.lr,
                                           betas=config.optim.betas,
                                           weight_decay=config.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.llm = LLM(str(self.model_dir), **engine_options(config, self.context))
        self.lora_sync = self._build_lora_sync()
        if config.exact_logprobs is not False and not exact_conflicts(config):
            self.policy.use_exact_forward(self.llm.exact_forward(
                self.policy.model, config.lora.enabled and config.lora.sync_mode == "runtime",
                config.shared_prefix))
        if config.shared_prefix and self.policy.exact_forward is None and self.context.is_main:
            tqdm.write(self._unshared_note())
        if config.moe.routing_replay and self.llm.routing_format is None:
            raise ValueError(f"moe.routing_replay: {config.model} has no experts to route; "
                             "set it false.")
        self.policy.routing_replay = config.moe.routing_replay
        self.partial = None  # the collector that carries groups across steps
        if config.rollout.partial.enabled:
            self.partial = make_collector(self.llm, self.tokenizer, config.rollout,
                                          self._rollout_seed(1), self.task.environment)
        self.step, wandb_run_id = 0, None
        if self.resume_path is not None:
            self.step, wandb_run_id = load_trainer_state(self.resume_path, self.context.rank,
                                                         self.optimizer, self.scheduler)
            self.sync_weights()
        self.logger = MetricsLogger(config.logging, self.output_dir, to_dict(config),
                                    enabled=self.context.is_main, start_step=self.step,
                                    wandb_run_id=wandb_run_id)
        if config.rollout.quantization is not None and self.context.is_main:
            tqdm.write(self._quantized_rollout_note())

    # --- building ------------------------------------------------------------------------

    def _check_layout(self) -> None:
        config, world = self.config, self.context.world_size
        if config.rollout.prompts_per_step % world:
            raise ValueError(f"rollout.prompts_per_step={config.rollout.prompts_per_step} does "
                             f"not divide among {world} ranks: make it a multiple of {world}.")
        if config.lora.enabled and config.distributed == "fsdp2" and world > 1:
            raise ValueError("LoRA with FSDP2 is not supported: use distributed=ddp (the "
                             "adapter is small) or full fine-tuning.")
        if config.sync_alias and config.lora.enabled:
            raise ValueError("sync_alias applies to full updates: turn it off with LoRA.")
        if config.rollout.structured_outputs and self.task.environment is not None:
            raise ValueError("rollout.structured_outputs constrains single-turn completions: "
                             "leave it out for a task with an environment.")

    def _build_rewards(self) -> list[WeightedReward]:
        chosen = [(r.name, r.weight) for r in self.config.rewards] or self.task.default_rewards
        return [WeightedReward(name, resolve_reward(name, self.task.rewards), weight)
                for name, weight in chosen]

    def _build_policy(self) -> Policy:
        config = self.config
        source = self.model_dir
        resumed = self.resume_path
        if resumed is not None and not config.lora.enabled:
            source = resumed
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[config.dtype])
        if config.lora.enabled:
            model = self._add_adapter(model, resumed)
        value_head = ValueHead(model.config.hidden_size) if self.algorithm.uses_values else None
        if value_head is not None and resumed is not None:
            value_head.load_state_dict(load_file(resumed / "value_head.safetensors"))
        return Policy(model, value_head).to(self.context.device)

    def _add_adapter(self, model: torch.nn.Module, resumed: Path | None) -> torch.nn.Module:
        from peft import LoraConfig, PeftModel, get_peft_model

        if resumed is not None:
            return PeftModel.from_pretrained(model, resumed, is_trainable=True)
        lora = self.config.lora
        targets = list(lora.target_modules or model_class(model.config).lora_targets)
        return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha,
                                                target_modules=targets))

    def _build_reference(self) -> Policy | None:
        if not self.algorithm.needs_reference or self.config.lora.enabled:
            return None
        # from the starting model: on resume the policy holds the checkpoint's weights
        reference = AutoModelForCausalLM.from_pretrained(self.model_dir,
                                                         dtype=DTYPES[self.config.dtype])
        return Policy(reference.to(self.context.device).eval().requires_grad_(False))

    def _build_lora_sync(self) -> Any:
        if not self.config.lora.enabled:
            return None
        from tandem.sync import LoraSync

        return LoraSync(self.llm, mode=self.config.lora.sync_mode)

    def _quantized_rollout_note(self) -> str:
        """What corrects a quantized rollout's gap to the trainer: the exact forward (which
        quantizes alike), else the importance-sampling correction in force."""
        correction = self.config.importance_sampling
        if self.policy.exact_forward is not None:
            how = "the trainer's exact forward quantizes alike, so it stays on-policy bit for bit"
        elif correction.mode == "none":
            how = "importance_sampling.mode=none: nothing corrects the sampler's gap"
        else:
            how = (f"importance_sampling.mode={correction.mode} (clip_min={correction.clip_min},"
                   f" clip_max={correction.clip_max}) corrects the sampler's gap")
        return (f"rollout.quantization={self.config.rollout.quantization}: {how}; each step "
                "logs sampler_logprob_diff_*, is_ratio_* and behaviour_kl_*.")

    def _unshared_note(self) -> str:
        """Why this run computes every row whole although ``shared_prefix`` is on: only
        the exact forward shares prefixes, and it is off here."""
        config = self.config
        why = ", ".join(exact_conflicts(config)) or (
            "exact_logprobs: false" if config.exact_logprobs is False else
            "the engine's kernels are not batch-invariant (on CUDA: rollout.engine."
            "exact_logprobs: true)")
        return (f"shared_prefix: every row's prompt is computed whole: only the exact forward "
                f"shares prefixes, and it is off ({why}); transformers' forward runs instead.")

    def _lr_factor(self, step: int) -> float:
        warmup = self.config.optim.warmup_steps
        return min(1.0, (step + 1) / warmup) if warmup else 1.0

    # --- the loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run the remaining steps, checkpoint, and return before/after evaluation and paths."""
        config = self.config
        before = self.evaluate()
        bar = tqdm(range(self.step, config.steps), desc="train", unit="step",
                   disable=not (self.context.is_main and config.logging.progress_bar))
        history, checkpoint = [], None
        for _ in bar:
            history.append(metrics := self.train_step())
            self.logger.log(self.step, metrics)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}")
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                checkpoint = self.save_checkpoint()
        if checkpoint is None or not checkpoint.name.endswith(f"-{self.step}"):
            checkpoint = self.save_checkpoint()
        after = self.evaluate()
        self.logger.finish()
        return {"before": before, "after": after, "history": history,
                "checkpoint": str(checkpoint), "jsonl": self.logger.jsonl_path,
                "wandb_dir": self.logger.wandb_dir}

    def train_step(self) -> dict[str, float]:
        """One step: rollouts, rewards, optimizer step, weight update. Returns its metrics
        (averaged over ranks)."""
        self.step += 1
        wake_seconds = timed_wake(self.llm) or 0.0
        stats_before = self.llm.stats()
        batch = self._rollouts(self._examples(self.step), self._rollout_seed(self.step))
        engine_metrics = engine_round_metrics(stats_before, self.llm.stats())
        rollout = self.config.rollout
        sleep_seconds = timed_sleep(self.llm, rollout.sleep_level, self.partial is not None) \
            if rollout.sleep_between_steps else 0.0
        metrics, train_seconds = timed(self._optimize, batch, batch.rewards)
        metrics.update(sync_seconds=self.sync_weights(), train_seconds=train_seconds)
        if self.partial is not None and self.config.rollout.partial.carried_kv == "recompute":
            self.llm.engine.recompute_unfinished()
        metrics.update(batch.summary(), **engine_metrics, **batch.metrics)
        metrics.update(sleep_seconds=sleep_seconds, wake_seconds=wake_seconds,
                       lr=self.scheduler.get_last_lr()[0], weight_version=self.llm.weight_version)
        return all_reduce_metrics(metrics, self.context)

    def _rollouts(self, examples: list[Example], seed: int,
                  rollout: RolloutConfig | None = None) -> RolloutBatch:
        """Completions, or for a task with an environment, episodes; each group scored as it
        finishes (with partial rollouts, by the collector carried from step to step)."""
        collector = self.partial if rollout is None else None
        if collector is None:
            collector = make_collector(self.llm, self.tokenizer, rollout or self.config.rollout,
                                       seed, self.task.environment)
        return shared_rollouts(self.llm.tensor_parallel, examples, lambda shared, keep: (
            generate_groups(self.llm, collector, shared, self._score_group,
                            self._extra_example, keep)))

    def _examples(self, step: int) -> list[Example]:
        per_step, rank, world = (self.config.rollout.prompts_per_step, self.context.rank,
                                 self.context.world_size)
        first = (step - 1) * per_step
        return [self.task.train_example(self.config.seed, first + i)
                for i in range(rank, per_step, world)]

    def _extra_example(self, extra: int) -> Example:
        """The step's ``extra``-th extra prompt (dynamic sampling's, partial rollouts'): a
        stream of its own (negative indices), disjoint per step and engine from the steps'."""
        partial, dynamic = self.config.rollout.partial, self.config.rollout.dynamic_sampling
        per_step = dynamic.max_extra_prompts + partial.over_provision * partial.enabled
        slot = rollout_slot(self.config, self.context, self.step)
        return self.task.train_example(self.config.seed, -1 - (slot * per_step + extra))

    def _score_group(self, group: Group) -> None:
        columns = {key: [group.example[key]] * len(group.completions)
                   for key in group.example if key != "prompt"}
        group.rewards, group.per_function = compute_rewards(
            self.rewards, [group.example["prompt"]] * len(group.completions), group.completions,
            {**columns, "completion_ids": group.completion_ids})

    def _rollout_seed(self, step: int) -> int:
        rank = rollout_rank(self.config, self.context)  # one seed per engine
        return (self.config.seed * 1_000_003 + step) * 10_007 + rank * 1_009

    def _optimize(self, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
        device = self.context.device
        tokens = token_batch(batch.prompt_ids, batch.completion_ids,
                             self.tokenizer.pad_token_id or 0, device)
        mask = tokens.completion_mask
        if batch.loss_masks is not None:  # an episode's environment tokens are not learned
            mask = mask * pad_rows(batch.loss_masks, tokens.num_completion_slots, 0,
                                   torch.float32).to(device)
        sampler_logprobs = pad_rows(batch.sampler_logprobs, tokens.num_completion_slots, 0.0,
                                    torch.float32).to(device)
        rollout = self.config.rollout  # replay what the engine's sampling kept, if it cut
        tokens.replay = sampling_replay(
            batch.sampling_thresholds, batch.completion_ids,
            self.llm.compile_grammar(rollout_params(rollout, 0)),
            tokens.num_completion_slots, rollout.top_k, rollout.top_p, device)
        if batch.routed_experts is not None:  # a mixture of experts: the sampler's routing
            tokens.routing = routing_rows(
                batch.routed_experts, [len(ids) for ids in batch.prompt_ids],
                tokens.input_ids.shape[1] - tokens.num_completion_slots,
                tokens.input_ids.shape[1]).to(device)
        slices = self._micro_batches(tokens, batch.group_ids)
        targets = self.algorithm.prepare(
            rewards.to(device), batch.group_ids.to(device), mask,
            lambda values, reference: self._score(tokens, slices, values, reference))
        self.model.train()
        self.policy.routing_counts = RoutingCounts()  # the trained passes' own routing
        num_rows, num_tokens = len(batch.completion_ids), int(mask.sum())
        losses, parts = [], []
        for index, rows in enumerate(slices):
            set_gradient_sync(self.model, index == len(slices) - 1)
            with self._autocast():
                logprobs, values, differs = self.model(tokens.rows(rows),
                                                       self.config.rollout.temperature)
            micro = MicroBatch(rows, logprobs, values, sampler_logprobs[rows], mask[rows],
                               num_rows, num_tokens, self.config.rollout.max_tokens)
            loss, micro_metrics = self.algorithm.loss(micro, targets)
            if differs is not None:
                micro_metrics["sampling_set_differs_fraction"] = masked_mean(differs, mask[rows])
            loss.backward()
            losses.append(loss.detach())
            parts.append(micro_metrics)
        grad_norm = self._optimizer_step()
        return {"loss": float(torch.stack(losses).sum()), "grad_norm": grad_norm,
                **combine_metrics(parts), **self.policy.routing_counts.metrics()}

    def _micro_batches(self, tokens: TokenBatch, group_ids: torch.Tensor) -> list[slice]:
        """The step's micro-batches: whole groups packed by their cost where the forward
        shares prefixes, else rows every ``optim.micro_batch_size``."""
        size, exact = self.config.optim.micro_batch_size, self.policy.exact_forward
        if exact is None or not exact.shared_prefix:
            return row_slices(tokens.input_ids.shape[0], size)
        return group_slices(tokens, group_ids, size)

    @torch.no_grad()
    def _score(self, tokens: TokenBatch, slices: list[slice], with_values: bool,
               use_reference: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and values) of every row without gradient, by the policy or the
        reference (the policy with its adapter disabled, under LoRA), over ``slices`` (the
        reference, through transformers, in rows every ``optim.micro_batch_size``)."""
        model = self.reference if use_reference and self.reference is not None else self.policy
        adapter_off = use_reference and self.reference is None
        if model.exact_forward is None:
            slices = row_slices(tokens.input_ids.shape[0], self.config.optim.micro_batch_size)
        logprobs, values, tokens = [], [], tokens.unmeasured()
        with self.policy.model.disable_adapter() if adapter_off else nullcontext(), \
                self._autocast():
            for rows in slices:
                micro_logprobs, micro_values, _ = model(tokens.rows(rows),
                                                        self.config.rollout.temperature)
                logprobs.append(micro_logprobs)
                values.append(micro_values)
        return torch.cat(logprobs), torch.cat(values) if with_values else None

    def _autocast(self) -> Any:
        if self.config.autocast is None:
            return nullcontext()
        return torch.autocast(self.context.device.type, dtype=DTYPES[self.config.autocast])

    def _optimizer_step(self) -> float:
        max_norm = self.config.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # --- the engine ----------------------------------------------------------------------

    def sync_weights(self) -> float:
        """Push the policy's weights (or its adapter) into the engine; returns the seconds
        (with the memory of weights ``sleep_level`` 2 discarded mapped back first)."""
        def push() -> None:
            if self.config.rollout.sleep_level == 2 and self.llm.is_sleeping:
                self.llm.wake_up(["weights"])  # their memory, discarded, is mapped back
            self._push(self.policy.model)

        return timed(push)[1]

    def _push(self, model: torch.nn.Module) -> None:
        """The whole policy (by copy or alias), or through ``LoraSync`` its adapter."""
        if self.lora_sync is not None:
            from tandem.sync import peft_adapter_state

            self.lora_sync.update(*peft_adapter_state(model))
            return
        # A list (nothing changes it before the commit): staged by reference where dtypes match.
        self.llm.update_weights(list(full_named_parameters(model)), alias=self.config.sync_alias)

    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts: each reward's mean, and ``accuracy``
        (the mean of ``eval_reward``, default the first reward). Empty when ``eval_size`` is 0.
        """
        size = self.config.eval_size
        if not size:
            return {}
        timed_wake(self.llm)
        if self.partial is not None:  # a step boundary, as a checkpoint: its own requests only
            self.partial.drop_carried()
        examples = self.task.eval_examples[:size][self.context.rank::self.context.world_size]
        batch = self._rollouts(examples, seed=0, rollout=evaluation_rollout(self.config.rollout))
        metrics = {f"eval_{name}": float(values.mean())
                   for name, values in batch.per_function.items()}
        accuracy_reward = self.config.eval_reward or self.rewards[0].name
        metrics["accuracy"] = metrics[f"eval_{accuracy_reward}"]
        return all_reduce_metrics(metrics, self.context)

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write ``output_dir/checkpoint-STEP``: the model as a Hugging Face folder (or the
        adapter), the value head, the step, config and W&B run id, and per rank the optimizer,
        schedule and RNG state. Groups carried by partial rollouts are dropped here (a step
        boundary)."""
        if self.partial is not None:
            self.partial.drop_carried()
        path = self.output_dir / f"checkpoint-{self.step}"
        weights = dict(full_named_parameters(self.policy))
        with staged_folder(path, self.context.is_main, lambda: _barrier(self.context)) as stage:
            run_state = None
            if self.context.is_main:
                save_policy(stage, self.policy.model, weights, self.tokenizer,
                            self.config.lora.enabled)
                run_state = {"config": to_dict(self.config),
                             "wandb_run_id": self.logger.wandb_run_id}
            save_trainer_state(stage, self.step, self.context.rank, run_state, self.optimizer,
                               self.scheduler)
        if self.context.is_main:
            prune_checkpoints(self.output_dir, self.config.checkpoint_keep)
        return path


def _barrier(context: Any) -> None:
    if context.world_size > 1:
        torch.distributed.barrier()
