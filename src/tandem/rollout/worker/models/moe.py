"""Mixture-of-experts layers: a router picks each token's top-k experts, and only those run.

``FusedMoE`` holds every expert's weights stacked, as transformers 5 holds them in memory
(``gate_up_proj`` ``[E, 2I, H]``, gate rows first; ``down_proj`` ``[E, H, I]``), each rank
its slice of every expert's intermediate dimension under tensor parallelism (vLLM's layout:
gate/up split by output, down by input, one all-reduce after the block). Its weight spec
maps the checkpoints' one tensor per expert (``experts.3.gate_proj.weight``, or Mixtral's
``w1``/``w3``/``w2``) into the stacked parameters' slots; ``aliases`` maps the stacked
tensors a trainer's ``named_parameters()`` gives onto those names, so updates take either
layout.

GPT-OSS's experts (``MoeSpec.transposed``) are held as transformers holds them, under its
names: ``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved (gate the even outputs,
up the odd), ``down_proj`` ``[E, I, H]``, and their biases ``gate_up_proj_bias`` ``[E, 2I]``
and ``down_proj_bias`` ``[E, H]``: a checkpoint (once its MXFP4 tensors are dequantized)
and a trainer's ``named_parameters()`` bind name for name with no copy. Each rank holds its
slice of the outputs (``"expert_out"``: whole gate/up pairs, as the pairs are adjacent) and
of down's inputs; the down bias on rank 0 only (``"row_bias"``). The matmuls read the
weights as ``[E, out, in]`` views (``transpose(1, 2)``), so every path below serves both
layouts; the biases are added after each matmul (as transformers adds them, after the
matmul's rounding). The router has a bias, takes the top k of its logits, then a softmax
over them in their dtype (``MoeSpec.topk_first``), and the activation is the clamped
SwiGLU (``ClampedSwiGLU``).

The experts run grouped: the token-expert pairs sorted by expert, each expert's rows through
its weights, each output weighted and added to its token in ascending expert order. The
matmuls follow the model's linear plan (``pack_weights``/``multiply_through``, as its linear
layers do): with the CPU ``"panels"`` layout one call per projection for every expert
(``cpu_linear.grouped_panel_linear`` over the experts' stacked panels, a copy rebuilt when
the parameter changes); else one matmul per expert, by ``F.linear`` or a kernel of the
plan's own (Triton's batch-invariant matmul, a trainer's differentiable one); with the
Triton kernels and no plan (``LayerKernels.fused_moe``) one grouped matmul per projection
(``kernels/triton_moe.py``). With the panels or Triton's, a
token's experts, weights and output keep their bits whatever batch it runs in: exact
log-probs, and the trainer routes as the sampler did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import KernelOps, cpu_linear
from tandem.kernels.layers import expert_counts

from ...parallel.tensor_parallel import COLUMN, EXPERT_OUT, ROW, ROW_BIAS, TensorParallel
from .layers import Linear
from .weight_spec import WeightTarget


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation of its gate and up outputs: ``(clamp(up, -limit, limit) +
    1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, each operation in the model
    dtype as transformers computes it. The sigmoid is ``exact_sigmoid``: a value's bits never
    depend on its place in the batch (exact log-probs)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of ``gate`` and ``up`` (of one shape, any strides)."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * exact_sigmoid(gate * self.alpha))


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """One family's expert layout: how many experts, how many a token takes, whether the
    top-k weights are renormalised to sum to one, the experts' intermediate size, and the
    checkpoint's names (the gate, up and down projections' module names; the block's module
    name in checkpoints where it differs from ``mlp``).

    GPT-OSS's options (the defaults are Qwen-MoE's and Mixtral's): ``transposed``, the
    experts held as transformers' GPT-OSS holds them (see the module docstring), with
    biases; ``activation``, an activation of gate and up other than ``silu(gate) * up``;
    ``router``, the router's module name, and ``router_bias``; ``topk_first``, the top k of
    the router's logits, then a softmax over those k in the logits' dtype, instead of a
    softmax over every expert in float32, then the top k.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_block: str = "mlp"
    transposed: bool = False
    activation: ClampedSwiGLU | None = None
    router: str = "gate"
    router_bias: bool = False
    topk_first: bool = False


class FusedMoE(nn.Module):
    """Every expert of one layer, stacked, run grouped by expert (see the module docstring)."""

    def __init__(self, hidden_size: int, spec: MoeSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.spec, self.ops, self.tp = spec, ops, tp
        experts, intermediate = spec.num_experts, spec.intermediate_size // tp.size
        if spec.transposed:  # [E, in, out], with biases (GPT-OSS)
            self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden_size, 2 * intermediate))
            self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden_size))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden_size))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden_size))
            self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, intermediate))
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.linear: Callable[..., torch.Tensor] | None = None  # see multiply_through
        self.routed = torch.empty(0, spec.top_k, dtype=torch.long)  # the last forward's
        self.own_routed = self.routed
        # Experts to use instead of the router's own ([tokens, top_k]; -1: its own), set by
        # a trainer replaying the sampler's routing (routing replay) for one forward.
        self.forced: torch.Tensor | None = None
        self.panels: dict[str, tuple[tuple, torch.Tensor]] | None = None

    def pack_weights(self, layout: str | None) -> None:
        """Multiply each expert in the CPU ``layout``: its panels for ``"panels"``,
        ``F.linear`` on the stacked weights otherwise."""
        self.linear = None
        self.panels = {} if layout == "panels" else None

    def multiply_through(self, linear: Callable[..., torch.Tensor]) -> None:
        """Multiply each expert through ``linear(x, weight, bias)``, its weight a view of
        the stacked parameter at each call."""
        self.linear, self.panels = linear, None

    @property
    def capturable(self) -> bool:
        """True when a forward queues on the device without reading anything back, so a
        CUDA graph can capture it: the fused grouped path (``LayerKernels.fused_moe``). The
        per-expert loop (a plan's own matmul: exact log-probs on CUDA) slices each expert's
        rows by its count, read on the host."""
        return self.ops.layers.fused_moe is not None and self.linear is None \
            and self.panels is None

    def weight(self, name: str) -> torch.Tensor:
        """The stacked weight ``name`` as ``[E, out, in]`` (a view of a transposed one)."""
        weight = getattr(self, name)
        return weight.transpose(1, 2) if self.spec.transposed else weight

    def _expert_linear(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        out = (self.linear or F.linear)(x, self.weight(name)[expert], None)
        return _add_bias(out, getattr(self, f"{name}_bias"), expert)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of the gate/up projection's output (its halves, or its even and
        odd outputs where they are interleaved)."""
        gate, up = _gate_and_up(gate_up, self.spec.transposed)
        return (self.spec.activation or self.ops.silu_and_mul)(gate, up)

    def _grouped_linear(self, x: torch.Tensor, name: str, offsets: torch.Tensor
                        ) -> torch.Tensor:
        """Every expert's rows of ``x`` through its panels of ``name`` in one call; the
        panels rebuilt after an in-place write (an update's copy bumps the version)."""
        weight = self.weight(name)
        key = (weight.data_ptr(), weight._version, weight.dtype)
        cached = self.panels.get(name)
        if cached is None or cached[0] != key:
            panels = _expert_panels(weight.detach(), None if cached is None else cached[1])
            cached = self.panels[name] = (key, panels)
        return cpu_linear.grouped_panel_linear(x.contiguous(), cached[1], offsets,
                                               weight.shape[1])

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """Each expert's gate, up and down tensors, by the checkpoint's names, in their
        slots of the stacked parameters; transposed, the stacked tensors and biases under
        transformers' names, each a whole parameter."""
        if self.spec.transposed:
            splits = {"gate_up_proj": EXPERT_OUT, "gate_up_proj_bias": EXPERT_OUT,
                      "down_proj": ROW, "down_proj_bias": ROW_BIAS}
            return {f"{prefix}.{name}": WeightTarget(f"{prefix}.{name}", split)
                    for name, split in splits.items()}
        gate, up, down = self.spec.names
        stem = _checkpoint_stem(prefix, self.spec)
        targets = {}
        for expert in range(self.spec.num_experts):
            name = f"{stem}.{expert}"
            targets[f"{name}.{gate}.weight"] = WeightTarget(
                f"{prefix}.gate_up_proj", COLUMN, ((expert, None), (0, 2)))
            targets[f"{name}.{up}.weight"] = WeightTarget(
                f"{prefix}.gate_up_proj", COLUMN, ((expert, None), (1, 2)))
            targets[f"{name}.{down}.weight"] = WeightTarget(
                f"{prefix}.down_proj", ROW, ((expert, None),))
        return targets

    def aliases(self, prefix: str, name: str, tensor: torch.Tensor
                ) -> list[tuple[str, torch.Tensor]] | None:
        """A stacked tensor of this layer (``prefix.gate_up_proj`` ``[E, 2I, H]`` or
        ``prefix.down_proj``, transformers' names) as the per-expert tensors it holds, by the
        checkpoint's names (views); None for another name (every name, transposed: its
        tensors are the spec's own)."""
        if self.spec.transposed:
            return None
        gate, up, down = self.spec.names
        stem = _checkpoint_stem(prefix, self.spec)
        if name == f"{prefix}.gate_up_proj" and tensor.dim() == 3:
            half = tensor.shape[1] // 2
            return [pair for expert in range(tensor.shape[0]) for pair in (
                (f"{stem}.{expert}.{gate}.weight", tensor[expert, :half]),
                (f"{stem}.{expert}.{up}.weight", tensor[expert, half:]))]
        if name == f"{prefix}.down_proj" and tensor.dim() == 3:
            return [(f"{stem}.{expert}.{down}.weight", tensor[expert])
                    for expert in range(tensor.shape[0])]
        return None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for each token of ``x`` ``[tokens, hidden]`` (this
        rank's partial sum under tensor parallelism)."""
        spec = self.spec
        weights, experts = route(router_logits, spec.top_k, spec.renormalize, spec.topk_first)
        self.own_routed = experts  # the router's own choice, before any replay
        if self.forced is not None:
            weights, experts = replayed(router_logits, self.forced, experts, spec.renormalize,
                                        spec.topk_first)
        self.routed = experts  # each token's experts, for routing replay
        if self.capturable:
            return self.ops.layers.fused_moe(
                x, self.weight("gate_up_proj"), self.weight("down_proj"), experts, weights,
                spec.activation or self.ops.silu_and_mul, gate_up_bias=self.gate_up_proj_bias,
                down_bias=self.down_proj_bias, interleaved=spec.transposed)
        return self._grouped(x, weights.to(x.dtype), experts)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                 ) -> torch.Tensor:
        """Each token's experts' outputs, computed with the token-expert pairs sorted by
        expert (one grouped call per projection with the panels, else one matmul per
        expert), weighted and added per token in ascending expert order."""
        top_k, num_experts = self.spec.top_k, self.spec.num_experts
        order = experts.flatten().argsort(stable=True)
        counts = expert_counts(experts.flatten(), num_experts)
        rows = x[order // top_k]
        if self.panels is not None:
            offsets = F.pad(counts.cumsum(0), (1, 0))
            row_experts = experts.flatten()[order]
            gate_up = _add_bias(self._grouped_linear(rows, "gate_up_proj", offsets),
                                self.gate_up_proj_bias, row_experts)
            hidden = _add_bias(self._grouped_linear(self._activation(gate_up), "down_proj",
                                                    offsets), self.down_proj_bias, row_experts)
        else:
            pieces, start = [], 0
            for expert, count in enumerate(counts.tolist()):
                if count:
                    gate_up = self._expert_linear(rows[start:start + count], "gate_up_proj",
                                                  expert)
                    pieces.append(self._expert_linear(self._activation(gate_up), "down_proj",
                                                      expert))
                start += count
            hidden = torch.cat(pieces)
        pairs = torch.empty_like(hidden)
        pairs[order] = hidden * weights.flatten()[order, None]  # back in (token, slot) order
        pairs = pairs.view(len(x), top_k, -1)
        ranked = pairs.gather(1, experts.argsort(dim=-1)[..., None].expand_as(pairs))
        out = ranked[:, 0]
        for slot in range(1, top_k):  # one fixed order of additions for every token
            out = out + ranked[:, slot]
        return out

def _gate_and_up(gate_up: torch.Tensor, interleaved: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up parts of a gate/up projection's output ``[rows, 2I]`` (views): its
    halves, or its even and odd outputs (GPT-OSS's interleaving)."""
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None,
              experts: torch.Tensor | int) -> torch.Tensor:
    """``out`` plus each row's expert's bias (``experts``: per row, or one for every row),
    after the matmul as transformers adds it; ``out`` itself without a bias."""
    return out if bias is None else out + bias[experts]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, topk_first: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights: softmax over the experts in float32
    (transformers' order), the top k, renormalised to sum to one where the family does; or
    with ``topk_first`` (GPT-OSS) the top k of the logits, then a softmax over those k in the
    logits' dtype."""
    if topk_first:
        top, experts = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def replayed(router_logits: torch.Tensor, forced: torch.Tensor, own: torch.Tensor,
             renormalize: bool, topk_first: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay: the ``forced`` experts (``[tokens, k]``; a -1 row keeps ``own``),
    each weighted by the router's own probability of it, renormalised as ``route``; with
    ``topk_first``, a softmax over their logits, as ``route`` weighs its own top k (so
    replaying the router's own choice changes no bit)."""
    experts = torch.where(forced[:, :1] >= 0, forced, own)
    if topk_first:
        chosen = router_logits.gather(-1, experts)
        return torch.softmax(chosen, dim=-1, dtype=chosen.dtype), experts
    weights = torch.softmax(router_logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    """A router (``gate``, or the module name ``MoeSpec.router`` gives it: GPT-OSS's
    ``router``, with a bias; replicated) and the experts, and optionally a shared expert
    every token takes (Qwen2-MoE's: a gated MLP, its output scaled by
    ``sigmoid(shared_expert_gate(x))``, sharded like the experts); one all-reduce adds the
    ranks' partial sums."""

    def __init__(self, hidden_size: int, spec: MoeSpec, ops: KernelOps,
                 tp: TensorParallel, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.add_module(spec.router, Linear(hidden_size, spec.num_experts, spec.router_bias))
        self.experts = FusedMoE(hidden_size, spec, ops, tp)
        self.shared_expert = shared_expert  # a ``LlamaMLP``: its ``partial`` is used
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.tp = tp

    def linear_groups(self) -> list[nn.Module]:
        """The router, and the shared expert's gate, input projections and down projection."""
        if self.shared_expert is None:
            return [self.router_layer()]
        shared = self.shared_expert
        return [self.router_layer(), self.shared_expert_gate, shared.gate_up, shared.down_proj]

    def router_layer(self) -> Linear:
        """The router (``gate``, or ``MoeSpec.router``)."""
        return getattr(self, self.experts.spec.router)

    def aliases(self, prefix: str, name: str, tensor: torch.Tensor
                ) -> list[tuple[str, torch.Tensor]] | None:
        """The router's weight under the checkpoint's block name (Mixtral's
        ``block_sparse_moe.gate.weight``) as this block's ``gate.weight``; None otherwise."""
        layer, spec = prefix.rpartition(".")[0], self.experts.spec
        if name == f"{layer}.{spec.checkpoint_block}.{spec.router}.weight":
            return [(f"{prefix}.{spec.router}.weight", tensor)]
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for each token of ``x`` ``[tokens, hidden]``."""
        out = self.experts(x, self.router_layer()(x))
        if self.shared_expert is not None:  # as transformers adds it: experts + gated shared
            gate = exact_sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert.partial(x)
        return self.tp.all_reduce(out)


def exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` of every element of ``x``, with the same bits for an element whatever
    else shares the tensor: as a softmax over the pair ``[x, 0]``. (``torch.sigmoid`` on CPU
    takes the vector path for most elements and a scalar one for the tail, whose last bits
    differ, so a token's value would depend on its position in the batch; a softmax works
    per row, here per pair.)"""
    pair = torch.stack([x, torch.zeros_like(x)], dim=-1)
    return torch.softmax(pair, dim=-1, dtype=torch.float32)[..., 0].to(x.dtype)


def _checkpoint_stem(prefix: str, spec: MoeSpec) -> str:
    """The checkpoint's name of the experts module ``prefix`` (``...mlp.experts``), whose
    block a family's checkpoints may name otherwise (Mixtral's ``block_sparse_moe``)."""
    block, _, experts = prefix.rpartition(".")
    layer, _, _ = block.rpartition(".")
    return f"{layer}.{spec.checkpoint_block}.{experts}"


def _expert_panels(weight: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Every expert's ``cpu_linear.panel_layout`` of the stacked ``weight`` ``[E, out, in]``,
    stacked ``[E, panels, in, PANEL]``: written over ``previous`` (the panels of the last
    version) where its shape and dtype match, so a re-layout after an update touches no new
    memory."""
    experts, out_features, in_features = weight.shape
    shape = (experts, -(-out_features // cpu_linear.PANEL), in_features, cpu_linear.PANEL)
    panels = previous if previous is not None and previous.shape == shape and \
        previous.dtype == weight.dtype else weight.new_empty(shape)
    for expert in range(experts):
        cpu_linear.panel_layout(weight[expert], out=panels[expert])
    return panels
