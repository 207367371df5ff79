"""The trainer's side of the model: padded token batches and per-token log-probs (and values).

Rows are laid out as TRL lays them: the prompt left-padded, the completion right-padded, so
the logits of the last ``C + 1`` positions score the ``C`` completion slots of every row.
Position ids count real tokens only, as the engine's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tandem.rollout.structured_outputs import Grammar, grammar_bitmasks, unpack_bitmask
from tandem.rollout.worker.exact_forward import ExactForward
from tandem.rollout.worker.sampler import apply_top_k, apply_top_p

from .routing import RoutingCounts, routed_as


@dataclass(slots=True)
class SamplingReplay:
    """What the engine's processed sampling kept, to rebuild its distribution exactly: the
    structured-outputs grammar's allowed tokens, then the truncated set among them.

    Attributes:
        thresholds: ``[B, C]`` per completion slot the engine's kept-set threshold (the
            logit after temperature halfway between its last kept and first dropped token;
            -inf where nothing was dropped); None when sampling did not truncate.
        top_k: the rollout's top-k (0: off), to count where the trainer's own set differs.
        top_p: the rollout's top-p (1: off), the same.
        grammar_masks: ``[B, C, ceil(V / 32)]`` int32, per slot the packed mask of tokens
            the grammar allowed (``grammar_bitmasks``); None without structured outputs.
        measure: count those differences (a sort over the vocabulary per token); off for
            no-grad scoring passes, whose count no one reads.
    """

    thresholds: torch.Tensor | None
    top_k: int
    top_p: float
    grammar_masks: torch.Tensor | None = None
    measure: bool = True

    def rows(self, rows: slice) -> SamplingReplay:
        """The replay of rows ``rows``."""
        return dataclasses.replace(self, thresholds=_part(self.thresholds, rows),
                                   grammar_masks=_part(self.grammar_masks, rows))

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, C, V]`` the tokens the grammar allowed (all, without one)."""
        if self.grammar_masks is None:
            return torch.ones_like(logits, dtype=torch.bool)
        return unpack_bitmask(self.grammar_masks, logits.shape[-1])

    def kept(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``[B, C, V]`` the engine's kept set, rebuilt on ``logits`` (after temperature):
        every allowed token at or above the threshold, and always the sampled one."""
        kept = self.allowed(logits)
        if self.thresholds is not None:
            kept &= logits >= self.thresholds.unsqueeze(-1)
        return kept.scatter(-1, token_ids.unsqueeze(-1), True)

    def own_set_differs(self, logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """``[B, C]`` 1 where the trainer's own top-k / top-p set on ``logits`` (among the
        allowed tokens) is not the engine's (float noise moved a token across the
        boundary)."""
        logits = logits.detach().masked_fill(~self.allowed(logits), float("-inf"))
        rows = logits.reshape(-1, logits.shape[-1])
        if self.top_k:
            rows = apply_top_k(rows, [self.top_k] * rows.shape[0])
        if self.top_p < 1.0:
            rows = apply_top_p(rows, rows.new_full((rows.shape[0],), self.top_p))
        own = torch.isfinite(rows).reshape(kept.shape)
        return (own != kept).any(dim=-1).float()


@dataclass(slots=True)
class TokenBatch:
    """Rows of prompt + completion as padded tensors.

    Attributes:
        input_ids: ``[B, P + C]``, prompts left-padded to ``P``, completions right-padded to
            ``C``.
        attention_mask: ``[B, P + C]``, 1 on real tokens.
        position_ids: ``[B, P + C]``, the index of each token within its row's real tokens.
        completion_ids: ``[B, C]``.
        completion_mask: ``[B, C]``, 1 on real completion tokens.
        replay: the engine's truncation per slot (None when sampling did not truncate).
        routing: ``[B, P + C, layers, k]`` the sampler's experts per position of a mixture
            of experts (-1 where none; ``routing.routing_rows``), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    replay: SamplingReplay | None = None
    routing: torch.Tensor | None = None

    @property
    def num_completion_slots(self) -> int:
        """``C``, the padded completion length."""
        return self.completion_ids.shape[1]

    def unmeasured(self) -> TokenBatch:
        """The same batch, its replay (if any) not counting differing sets."""
        if self.replay is None:
            return self
        return dataclasses.replace(self, replay=dataclasses.replace(self.replay, measure=False))

    def rows(self, rows: slice) -> TokenBatch:
        """The batch of rows ``rows`` (same padding)."""
        return TokenBatch(self.input_ids[rows], self.attention_mask[rows],
                          self.position_ids[rows], self.completion_ids[rows],
                          self.completion_mask[rows],
                          None if self.replay is None else self.replay.rows(rows),
                          None if self.routing is None else self.routing[rows])


def pad_rows(rows: list[list[float]] | list[list[int]], width: int, value: float,
             dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    """A ``[len(rows), width]`` tensor of ``rows`` padded with ``value`` (on the left if asked)."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            target = out[i, width - len(row):] if left else out[i, :len(row)]
            target.copy_(torch.tensor(row, dtype=dtype))
    return out


def _part(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]


def sampling_replay(thresholds: list[list[float]] | None, completion_ids: list[list[int]],
                    grammar: Grammar | None, width: int, top_k: int, top_p: float,
                    device: torch.device) -> SamplingReplay | None:
    """The replay of a rollout batch (``width`` completion slots): the engine's per-token
    thresholds when it truncated, and the masks of ``grammar`` (structured outputs) replayed
    over the completions; None when sampling neither truncated nor was constrained."""
    if thresholds is None and grammar is None:
        return None
    return SamplingReplay(
        None if thresholds is None else
        pad_rows(thresholds, width, float("-inf"), torch.float32).to(device), top_k, top_p,
        None if grammar is None else
        grammar_bitmasks(grammar, completion_ids, width).to(device))


def token_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                device: torch.device | str = "cpu") -> TokenBatch:
    """Pad prompts on the left and completions on the right into one ``TokenBatch``."""
    prompt_width = max(len(ids) for ids in prompt_ids)
    completion_width = max(max(len(ids) for ids in completion_ids), 1)
    prompts = pad_rows(prompt_ids, prompt_width, pad_id, torch.long, left=True)
    prompt_mask = pad_rows([[1] * len(ids) for ids in prompt_ids], prompt_width, 0, torch.long,
                           left=True)
    completions = pad_rows(completion_ids, completion_width, pad_id, torch.long)
    completion_mask = pad_rows([[1] * len(ids) for ids in completion_ids], completion_width, 0,
                               torch.long)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return TokenBatch(torch.cat([prompts, completions], dim=1).to(device),
                      attention_mask.to(device), position_ids.to(device),
                      completions.to(device), completion_mask.float().to(device))


def completion_logprobs(model: nn.Module, batch: TokenBatch, temperature: float,
                        value_head: nn.Module | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token log-probs ``[B, C]`` of the completion tokens under ``softmax(logits / T)``,
    in float32 (renormalised over the engine's kept set when ``batch.replay`` says sampling
    truncated), the value head's ``[B, C]`` values (state before each token) when given,
    and with a replay, ``[B, C]`` 1 where the trainer's own truncated set would differ.

    Only the last ``C + 1`` positions go through the LM head.
    """
    width = batch.num_completion_slots
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, logits_to_keep=width + 1,
                   output_hidden_states=value_head is not None, use_cache=False)
    logits = output.logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    differs = None
    if batch.replay is not None:
        kept = batch.replay.kept(logits.detach(), batch.completion_ids)
        if batch.replay.measure:
            differs = batch.replay.own_set_differs(logits, kept)
        logits = logits.masked_fill(~kept, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    token_logprobs = logprobs.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    if value_head is None:
        return token_logprobs, None, differs
    hidden = output.hidden_states[-1][:, -(width + 1):-1]
    values = value_head(hidden.to(value_head.weight.dtype)).squeeze(-1).float()
    return token_logprobs, values, differs


class ValueHead(nn.Linear):
    """PPO's critic: one linear map from the last hidden state to a scalar value."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)


class Policy(nn.Module):
    """The trained model (a Hugging Face causal LM, maybe a peft model) and, for PPO, its
    value head: one module, so DDP and FSDP2 wrap both."""

    def __init__(self, model: nn.Module, value_head: ValueHead | None = None) -> None:
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.exact_forward: ExactForward | None = None  # see use_exact_forward
        self.routing_replay = False  # route by the sampler's experts (a mixture of experts)
        self.routing_counts = RoutingCounts()  # own choices against the sampler's

    def use_exact_forward(self, exact_forward: ExactForward | None) -> None:
        """Run every forward pass through ``exact_forward`` (``LLM.exact_forward`` of this
        policy's model: the engine's log-probs bit for bit), or transformers' (None)."""
        self.exact_forward = exact_forward

    def forward(self, batch: TokenBatch, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``completion_logprobs`` of this policy (values too when it has a value head); a
        mixture of experts' routing counted against the sampler's, replayed with
        ``routing_replay`` (``routing.routed_as``)."""
        model = self.exact_forward or self.model
        with routed_as(model, batch.routing, batch.attention_mask, self.routing_replay,
                       self.routing_counts):
            return completion_logprobs(model, batch, temperature, self.value_head)
