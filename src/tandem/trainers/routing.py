"""Routing replay for mixture-of-experts policies: the trainer's forward routes each token to
the experts the sampler chose, and the step logs how often its own choice agreed.

The engine returns, per position of a completion's prompt and tokens whose forward ran,
each MoE layer's top-k experts (``SamplingParams.return_routed_experts``).
``routing_rows`` lays them out as the trainer's padded batch (``token_batch``), -1 where a
position has none (padding, a row's last token). ``routed_as`` wraps one forward pass:
under transformers it hooks every router (``*TopKRouter``, which returns logits, weights
and experts); under the engine's exact forward it hands them to the twin
(``ExactForward.routed``: its experts' ``FusedMoE.forced`` in the order of its stream, each
shared prefix once). Either way it counts, per position and layer, whether the model's
own top-k set equals the sampler's, and with ``replay`` it routes by the sampler's (each
chosen expert weighted by the model's own probability of it, renormalised as the family
does, so the router still learns; for GPT-OSS a softmax over the chosen experts' logits,
as its router weighs its own top k).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tandem.rollout.worker.exact_forward import ExactForward
from tandem.rollout.worker.models.moe import replayed

# transformers' routers that take the top k of their logits, then a softmax over those k
# (GPT-OSS's): replay weighs the sampler's experts the same way (``moe.replayed``)
TOPK_FIRST_ROUTERS = ("GptOssTopKRouter",)


@dataclass(slots=True)
class RoutingCounts:
    """Position-layer choices seen, and those where the model's own top-k set was the
    sampler's."""

    agreed: int = 0
    total: int = 0

    def add(self, own: torch.Tensor, sampler: torch.Tensor) -> None:
        """Count the rows of ``own`` and ``sampler`` (``[tokens, k]``; -1 rows skipped)."""
        valid = sampler[:, 0] >= 0
        same = (own[valid].sort(-1).values == sampler[valid].sort(-1).values).all(-1)
        self.agreed += int(same.sum())
        self.total += int(valid.sum())

    def metrics(self) -> dict[str, float]:
        """``routing_agreement`` (the fraction agreed), if anything was counted."""
        return {"routing_agreement": self.agreed / self.total} if self.total else {}


def routing_rows(routed: list[torch.Tensor], prompt_lengths: list[int], prompt_width: int,
                 width: int) -> torch.Tensor:
    """The engine's routing of each row (``[positions, layers, k]``) as ``[B, width,
    layers, k]`` in ``token_batch``'s layout (prompts left-padded to ``prompt_width``), -1
    where a position has none."""
    layers, top_k = routed[0].shape[1:]
    out = torch.full((len(routed), width, layers, top_k), -1, dtype=torch.long)
    for row, (experts, length) in enumerate(zip(routed, prompt_lengths, strict=True)):
        start = prompt_width - length
        count = min(experts.shape[0], width - start)
        out[row, start:start + count] = experts[:count].long()
    return out


@contextmanager
def routed_as(model: nn.Module, routing: torch.Tensor | None, attention_mask: torch.Tensor,
              replay: bool, counts: RoutingCounts) -> Iterator[None]:
    """One forward pass of ``model`` (transformers', or the exact forward's twin) whose
    routing is counted against ``routing`` ``[B, T, layers, k]`` and, with ``replay``,
    taken from it; nothing changes without ``routing``."""
    if routing is None:
        yield
        return
    routing = routing.to(attention_mask.device)
    if isinstance(model, ExactForward):
        with model.routed(routing, replay, counts.add):
            yield
        return
    flat = routing.flatten(0, 1)  # the routers see [B * T, hidden]
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [router.register_forward_hook(_router_hook(flat[:, layer], replay, counts))
             for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _router_hook(sampler: torch.Tensor, replay: bool, counts: RoutingCounts):
    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, weights, experts = output
        counts.add(experts, sampler)
        if not replay:
            return None
        # Mixtral's router always renormalises (it has no norm_topk_prob)
        scores, chosen = replayed(logits, sampler, experts,
                                  getattr(module, "norm_topk_prob", True),
                                  type(module).__name__ in TOPK_FIRST_ROUTERS)
        return logits, scores.to(weights.dtype), chosen
    return hook
