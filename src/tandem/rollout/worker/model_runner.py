"""Runs one scheduled step on the device: flatten, forward, project, sample.

The runner owns the model, the KV pool tensors and the sampler. Its ``InputBatch``
(``input_batch.py``, the block tables kept across steps) turns a ``ScheduledBatch`` into one
flat token stream (``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``,
``context_lens``, ``cu_seqlens_q``); the runner projects only the rows that sample through
the LM head. On CUDA with the Triton kernels it replays captured graphs for pure-decode
steps (``cuda_graphs.py``).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from tandem.kernels import AttentionMetadata, check_quantized, quantization, select_kernels
from tandem.kernels.cpu_build import MAX_GROUP, MAX_HEAD_DIM
from tandem.kernels.fp8_kv import FP8
from tandem.sync.protocol import WeightUpdateError, check_all_finite

from ..config import WorkerConfig
from ..core.block_manager import num_blocks_for
from ..core.scheduled_batch import ScheduledBatch
from ..core.sequence import Sequence
from ..outputs import RoutingFormat
from ..parallel.tensor_parallel import TensorParallel, full_from_slices, local_slice, lora_slice
from .attention_layout import long_tensor
from .cuda_graphs import DecodeGraphs, graph_addresses, graph_batch_sizes
from .device_sample import HostCopy, RoutedExperts
from .input_batch import InputBatch, ScoredPositions, StepInputs
from .loader import load_weights
from .memory import model_kv_groups
from .models import CausalLM, KVShape, build_model
from .models.layers import LoraLinear, stack_lora
from .models.moe import FusedMoE
from .models.weight_spec import views
from .releasable_memory import ReleasableMemory, releasable_or_none, typed_view
from .sampler import Sampler
from .weight_offload import OffloadableWeights


class ModelRunner:
    """Holds the model, its KV pool and its decode graphs, and executes scheduled steps.

    Graphs are captured only on CUDA, with an attention backend that can be captured
    (``captures_graphs``: Triton's; the torch reference synchronises with the device),
    experts that run without reading their counts on the host (``FusedMoE.capturable``: the
    fused Triton path, not the exact per-expert loop) and without ``enforce_eager``;
    ``graph_sizes`` is empty otherwise. On CPU the linear layers
    multiply in the layout timed fastest on this machine when the model loads
    (``kernels/cpu_linear.py``; ``model.linear_layout`` names it), or with exact log-probs
    in the batch-invariant panels. An FP8 pool (``kv_cache_dtype``) comes with its scales,
    ``kv_scales`` ``[2, layers, kv_heads]`` (K's, V's; this rank's heads), kept apart from the
    pool so that they outlive its release (sleep) and every weight update. With
    ``quantization`` the decoder layers' projections hold 8-bit weights (quantized after
    loading, and in every commit), multiplied through the panels on CPU and the Triton 8-bit
    matmul on CUDA.

    Raises:
        ValueError: where the KV cache dtype cannot run on this device, before anything is
            built.
    """

    def __init__(self, config: WorkerConfig, hf_config: PretrainedConfig,
                 tp: TensorParallel | None = None) -> None:
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype
        self.device = device
        self.exact_logprobs = config.exact_logprobs
        self.dtype = dtype
        self.block_size = config.block_size
        self.tp = tp or TensorParallel()
        self.ops = select_kernels(config.attention_backend, device, config.exact_logprobs)
        if config.quantization is not None:
            check_quantized(self.ops, device, config.quantization)
        self.model: CausalLM = build_model(hf_config, dtype, device, config.max_model_len,
                                           self.ops, self.tp)
        self.weight_spec = self.model.weight_spec()
        load_weights(self.model, Path(config.model_dir))
        if config.quantization is not None:  # vLLM's online quantization, after loading
            self.model.quantize_weights(config.quantization)
        self.model.eval()
        # On CUDA the weights live in one releasable region: sleep(1) offloads them in one copy.
        self.offloadable_weights = releasable_or_none(
            lambda: OffloadableWeights(self.model, device), "weights") \
            if device.type == "cuda" else None
        self._plan_linear_layers()
        self.sampler = Sampler(set(config.eos_token_ids), config.seed, device)
        self.kv_groups = model_kv_groups(hf_config, config.max_model_len)
        self.input_batch = InputBatch(config.block_size, device, self.ops.attention.cascade,
                                      self.kv_groups.num_groups)
        self.kv_cache = torch.empty(0)
        self.kv_region: ReleasableMemory | None = None
        self.kv_scales = self._bind_kv_scales()
        self.max_blocks_per_seq = num_blocks_for(config.max_model_len, config.block_size)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        captures = device.type == "cuda" and self.ops.attention.captures_graphs \
            and not config.enforce_eager and all(m.capturable for m in self.moe_layers)
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if captures else []
        self.graphs: DecodeGraphs | None = None
        self.graph_addresses: tuple[int, ...] | None = None  # what the graphs were captured over
        self.graph_captures = 0
        self.graph_capture_seconds = 0.0
        self.graph_bytes = 0
        self.record_routing = False  # this step records its experts: no graph replay
        # The last launch's sampling sequences (one per row) and sampled tokens (on the device).
        self._last_sampled: tuple[list[Sequence], torch.Tensor] = ([], torch.empty(0))

    def _plan_linear_layers(self) -> None:
        """How the linear layers multiply: batch-invariant with exact log-probs (whatever a
        timing chooses); quantized through the panels on CPU or the layer kernels' 8-bit
        matmul (Triton's), the other layers as they are; else on CPU the layout timed
        fastest."""
        layers, quantized = self.ops.layers, self.config.quantization is not None
        if self.config.exact_logprobs:
            self._multiply_batch_invariant()
        elif quantized and layers.cpu_linear_layouts:
            self.model.pack_linear_weights("panels")
        elif quantized:
            self.model.multiply_quantized_through(layers.quantized_linear)
        elif self.device.type == "cpu" and layers.cpu_linear_layouts:
            self.model.pack_linear_weights(self.model.fastest_linear_layout())

    def _multiply_batch_invariant(self) -> None:
        """Every linear layer through the backend's batch-invariant matmul: the panels (a
        copy) where the layers use the CPU layouts, else the layer kernels' own (Triton's
        fixed-tile matmul, over the weights as stored)."""
        layers = self.ops.layers
        if not layers.cpu_linear_layouts:
            self.model.multiply_through(layers.batch_invariant_linear,
                                        f"{layers.name} (batch-invariant)")
            return
        check_exact_shapes(self.kv_shape)
        self.model.pack_linear_weights("panels")

    def weight_parameters(self) -> dict[str, torch.Tensor]:
        """Every Hugging Face tensor of the weight spec (a tied one under its first name),
        as the part of its parameter it fills (the parameter itself where it fills all); a
        quantized one as a stand-in of its float shape and the model's dtype that takes no
        memory (a scalar expanded): updates send float weights, the commit quantizes them."""
        return dict(self._update_targets)

    @functools.cached_property
    def _parameters(self) -> dict[str, torch.Tensor]:
        # Walked once (0.5 ms an update on an H200): updates, offloads and aliases change a
        # parameter's data, never the parameter (quantizing replaced them before this).
        return views(self.weight_spec, dict(self.model.named_parameters()))

    @functools.cached_property
    def _scales(self) -> dict[str, torch.Tensor]:
        """The quantized tensors' per-channel scales, each the part of its layer's
        ``weight_scale`` its slot fills, by Hugging Face name."""
        buffers = dict(self.model.named_buffers())
        return {name: target.view(buffers[f"{target.parameter}_scale"])
                for name, target in self.weight_spec.items()
                if f"{target.parameter}_scale" in buffers}

    @functools.cached_property
    def _update_targets(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty((), dtype=self.dtype, device=view.device).expand(view.shape)
                if name in self._scales else view for name, view in self._parameters.items()}

    def tied_parameter_names(self) -> set[str]:
        """Names that share another parameter's tensor (e.g. a tied ``lm_head.weight``)."""
        every = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        return every - {target.parameter for target in self.weight_spec.values()}

    @torch.no_grad()
    def commit_weights(self, staged: dict[str, torch.Tensor], alias: bool) -> bool:
        """Copy (or with ``alias`` adopt) the staged tensors into the parameters; True when
        an adopted tensor moved a parameter to new storage. Aliasing ends the CPU weight
        layouts (copies would go stale: an aliased weight changes in place unseen)."""
        parameters, moved = self._parameters, False
        if not alias:
            self._copy_in(staged)
            return False
        stacked = sorted(name for name in staged if self.weight_spec[name].slot)
        if stacked:
            raise WeightUpdateError(f"cannot alias {stacked[0]!r}: the engine stacks it in "
                                    f"{self.weight_spec[stacked[0]].parameter!r} with other "
                                    "tensors; update by copy instead.")
        self.model.pack_linear_weights(None)
        for name, tensor in staged.items():
            moved |= parameters[name].data_ptr() != tensor.data_ptr()
            parameters[name].data = tensor
        return moved

    @torch.no_grad()
    def commit_slices(self, staged: dict[str, torch.Tensor]) -> list[int]:
        """Under tensor parallelism: cut this rank's slice of each full staged tensor, check
        it, and copy the slices in only if no rank refused its own (one vote); returns the
        refusing ranks."""
        targets, config = self._update_targets, self.model.config  # this rank's slices
        try:
            slices = {name: local_slice(self.weight_spec[name].split, tensor, config, self.tp).to(
                targets[name].device, targets[name].dtype, copy=True)
                for name, tensor in staged.items()}
            check_all_finite(slices.items())
        except (WeightUpdateError, RuntimeError, KeyError):
            slices = None
        refusing = self.tp.refusals(slices is not None)
        if not refusing:
            self._copy_in(slices)
        return refusing

    def _copy_in(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy each tensor into its parameter in one ``torch._foreach_copy_`` (a few kernels
        on a GPU; it bumps version counters as ``copy_``, so CPU packed copies rebuild); a
        quantized one's codes and scales from ``quantization.quantize`` (its finiteness was
        checked when it was staged)."""
        plain = [name for name in tensors if name not in self._scales]
        if plain:
            torch._foreach_copy_([self._parameters[name] for name in plain],
                                 [tensors[name] for name in plain])
        for name in tensors.keys() - set(plain):
            codes, scale = quantization.quantize(tensors[name], self.config.quantization)
            self._parameters[name].copy_(codes)
            self._scales[name].copy_(scale)

    def full_weight(self, name: str) -> torch.Tensor | None:
        """The whole weight ``name`` of a projection (or a replicated tensor): under tensor
        parallelism gathered from every rank's slice, on the driver (None on the other
        ranks) or with SPMD on every rank. A quantized weight is what it serves, dequantized
        to the model's dtype (``quantization.dequantize``)."""
        local = self._parameters[name].detach()
        if name in self._scales:
            local = quantization.dequantize(local, self._scales[name], self.dtype)
        if self.tp.size == 1:
            return local
        parts = self.tp.gather(local)
        return None if parts is None else full_from_slices(self.weight_spec[name].split,
                                                            parts, self.model.config, self.tp)

    def lora_layers(self) -> dict[str, LoraLinear]:
        """The layers that can add a run-time LoRA adapter, by Hugging Face weight name."""
        return {name: module for name, (module, _) in self._lora_parts.items()}

    @functools.cached_property
    def _lora_parts(self) -> dict[str, tuple[LoraLinear, int]]:
        # Walked once: the layers and their parts never change after the model is built.
        return self.model.lora_layers(self.weight_spec)

    def set_lora(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Serve run-time adapter factors (full ``A [r, in]``, ``B [out, r]``, scale) by
        weight name, each layer its rank's slice of them (a layer of several parts one
        adapter per part, ``stack_lora``); layers left out serve none."""
        per_layer: dict[LoraLinear, list] = {}
        for name, (module, part) in self._lora_parts.items():
            given = factors.get(name)
            parts = per_layer.setdefault(module, [None] * max(1, len(module.parts)))
            parts[part] = None if given is None else lora_slice(
                self.weight_spec[name].split, *given, self.model.config, self.tp)
        for module, parts in per_layer.items():
            if all(part is None for part in parts):
                module.set_lora(None)
            elif len(parts) == 1:
                module.set_lora(parts[0])
            else:
                module.set_lora(stack_lora(parts, list(module.part_rows)))

    def agreed_num_blocks(self, num_blocks: int) -> int:
        """``num_blocks``, or for the ranks of an SPMD engine (each sizes its pool from its
        own device's budget) the fewest of any rank: their schedulers must stay alike."""
        return self.tp.fewest(num_blocks) if self.tp.spmd else num_blocks

    def weight_bytes(self) -> int:
        """Bytes of the weights held: the model's parameters (tied ones counted once, 8-bit
        ones a byte each) and the scales of the quantized ones (``CausalLM.weight_bytes``)."""
        return self.model.weight_bytes()

    def staging_bytes(self) -> int:
        """Bytes a full weight update stages until its commit: every Hugging Face tensor in
        the model's dtype (a quantized one is staged as the trainer sends it, then
        quantized)."""
        return sum(view.numel() * self.dtype.itemsize if name in self._scales
                   else view.numel() * view.element_size()
                   for name, view in self._parameters.items())

    def _bind_kv_scales(self) -> torch.Tensor | None:
        """An FP8 pool's scales (1.0: ``fp8_kv.py`` says why), each layer's bound to its
        attention module as ``k_scale``/``v_scale``; None (and None bound) otherwise."""
        shape = self.kv_shape
        scales = torch.ones(2, shape.num_layers, shape.num_kv_heads, device=self.device) \
            if self.kv_dtype == FP8 else None
        for layer, attention in enumerate(self.model.attention_layers()):
            attention.k_scale = None if scales is None else scales[0, layer]
            attention.v_scale = None if scales is None else scales[1, layer]
        return scales

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool ``[2, rows, num_blocks, block_size, kv_heads, head_dim]`` of
        ``kv_dtype``, stored head-major (``pool_layout``); ``kv_heads`` this rank's. Each
        layer reads and writes its KV group's ``rows`` (``kv_groups.py``: every layer its
        own row where the model has one group) through its group's tables
        (``kv_group``).

        It lives in a ``ReleasableMemory``, zeroed: after ``free_kv_cache`` it comes back at
        the same address (the decode graphs hold it). On CPU it is resident where written.
        """
        shape = self.kv_shape
        groups = self.kv_groups
        storage, order = self.ops.attention.kv_layout((2, groups.rows, num_blocks,
                                                       self.block_size, shape.num_kv_heads,
                                                       shape.head_dim))
        num_bytes = math.prod(storage) * self.kv_dtype.itemsize
        if self.kv_region is None or self.kv_region.num_bytes != num_bytes:
            self.kv_region = releasable_or_none(
                lambda: ReleasableMemory(num_bytes, self.device), "KV cache")
        if self.kv_region is not None:
            self.kv_region.restore()
        flat = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device) \
            if self.kv_region is None else self.kv_region.tensor
        self.kv_cache = typed_view(flat, 0, storage, self.kv_dtype).permute(order)
        for layer, attention in enumerate(self.model.attention_layers()):
            attention.k_cache = self.kv_cache[0, groups.row_of[layer]]
            attention.v_cache = self.kv_cache[1, groups.row_of[layer]]
            attention.kv_group = groups.group_of[layer]

    @property
    def routing(self) -> RoutingFormat | None:
        """How this model's routing is encoded for ``return_routed_experts`` (None: it has
        no experts)."""
        if not self.moe_layers:
            return None
        spec = self.moe_layers[0].spec
        dtype = torch.uint8 if spec.num_experts <= 256 else torch.int16
        return len(self.moe_layers), spec.top_k, dtype

    def _routed_experts(self, batch: ScheduledBatch) -> RoutedExperts:
        """The step's experts, encoded (``routing``), left on the device, with each batch
        row that records its routing: its chunk's first position, first token and count."""
        _, _, dtype = self.routing
        experts = torch.stack([layer.routed for layer in self.moe_layers], dim=1).to(dtype)
        chunks, first = {}, 0
        for row, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.records_routing:
                chunks[row] = (seq.num_computed_tokens, first, count)
            first += count
        return RoutedExperts(experts, chunks)

    @property
    def kv_shape(self) -> KVShape:
        """What this rank's KV pool holds per token."""
        return type(self.model).kv_shape(self.model.config, self.tp.size)

    def kv_cache_bytes(self) -> int:
        """Bytes the KV pool holds (0 while freed)."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def capture_graphs(self) -> None:
        """Capture the decode graphs anew over the current pool and weights.

        Call it after the pool or a weight's storage moved (graphs hold addresses; see
        ``graphs_current``). Records the addresses, the capture's seconds and the device
        memory it took; without a ladder (no graphs) only the addresses.
        """
        self.graphs = None
        self.graph_addresses = graph_addresses(self.model, self.kv_cache)
        if not self.graph_sizes:
            return
        self._return_cached_device_memory()  # so the old graphs' pool does not hide the cost
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        graphs = DecodeGraphs(self.graph_sizes, self.max_blocks_per_seq, self.device,
                              self.ops.attention, self.kv_groups.num_groups)
        # The capture's side stream is the current device's, whatever thread captures.
        with torch.inference_mode(), torch.cuda.device(self.device):
            graphs.capture(self.model)
        self.graph_capture_seconds = time.perf_counter() - start
        self.graph_captures += 1
        self.graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.graphs = graphs

    def graphs_current(self) -> bool:
        """True when no capture is due: the decode graphs (none without a ladder) were
        captured over the addresses the model reads now (``graph_addresses``)."""
        return self.graph_addresses == graph_addresses(self.model, self.kv_cache)

    def drop_graphs(self) -> None:
        """Forget the decode graphs (their captured code path changed); the next
        ``capture_graphs`` makes new ones."""
        self.graphs, self.graph_addresses = None, None

    def free_kv_cache(self) -> None:
        """Release the KV pool's memory; ``allocate_kv_cache`` brings a zeroed pool back at
        the same address, so the decode graphs are kept."""
        self.kv_cache = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        for attention in self.model.attention_layers():
            attention.k_cache = attention.v_cache = self.kv_cache
        if self.kv_region is not None:
            self.kv_region.release()
        self._return_cached_device_memory()

    def offload_weights(self) -> None:
        """Move the weights to CPU memory (a no-op on CPU): on CUDA in one copy to pinned
        memory while the weights' region holds every parameter (buffers stay); else, after
        an alias update, parameter by parameter with the rotary tables (new addresses on
        reload, so ``graphs_current`` asks for a capture)."""
        weights = self._offloadable_weights()
        if weights is not None:
            weights.offload(self.model)
        else:
            self.model.to("cpu")
            self._move_rotary("cpu")
        self._return_cached_device_memory()

    def discard_weights(self) -> None:
        """Release the weights' memory without keeping them (``sleep(2)``; the next full
        update brings them back): on CUDA their region, remapped zeroed at the same
        addresses on ``reload_weights``; where no region holds them (on CPU, or after an
        alias update) they are kept as ``offload_weights`` keeps them."""
        weights = self._offloadable_weights()
        if weights is None:
            self.offload_weights()
            return
        weights.discard()
        self._return_cached_device_memory()

    def reload_weights(self) -> None:
        """Move the weights back to the engine's device: to their old addresses where they
        left in one copy (zeroed where they were discarded); anything else on CPU (LoRA
        factors set while asleep) follows."""
        weights = self._offloadable_weights()
        if weights is not None:
            weights.reload(self.model)
        self.model.to(self.device)
        self._move_rotary(self.device)

    def _offloadable_weights(self) -> OffloadableWeights | None:
        """The weights' region while it holds every parameter (an alias ends it for good)."""
        weights = self.offloadable_weights
        if weights is not None and not weights.holds(self.model):
            self.offloadable_weights = weights = None
        return weights

    def _return_cached_device_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand freed memory back to the trainer, not our cache

    def _move_rotary(self, device: torch.device | str) -> None:
        rotary = self.model.rotary_emb
        rotary.cos, rotary.sin = rotary.cos.to(device), rotary.sin.to(device)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after_unread: bool = False) -> HostCopy:
        """Queue ``batch``'s forward pass and sampling on the device; the samples come back
        through the returned copy, whose ``result`` waits for them.

        Copy-on-write block copies run first. ``after_unread``: the last launch's samples
        are not all read yet, so a decode whose newest token is pending (unknown to the
        host) reads it from them on the device. A row whose group forks in this step is
        sampled once per group member, each with its own parameters (and seed). Chunks that
        score prompt log-probs get them too (waiting for them).
        """
        step, num_sampling, scored = self._prepare(batch)
        if after_unread:
            self._read_pending_tokens(batch, step)
        self.record_routing = bool(self.moe_layers) and any(seq.records_routing
                                                            for seq in batch.seqs)
        logits = self.run_step(step).float()
        routed = self._routed_experts(batch) if self.record_routing else None
        sampling, prompt = logits[:num_sampling], logits[num_sampling:]
        groups = batch.sampling_groups()
        seqs = [seq for group in groups for seq in group]
        if len(seqs) > len(groups):
            sizes = self._long([len(group) for group in groups])
            sampling = sampling.repeat_interleave(sizes, dim=0, output_size=len(seqs))
        sample = self.sampler.sample(sampling, seqs)
        self._last_sampled = seqs, sample.token_ids
        return sample.to_host(self._prompt_logprobs(batch, prompt, scored), routed)

    def _read_pending_tokens(self, batch: ScheduledBatch, step: StepInputs) -> None:
        """Mark each decode of ``step`` whose token is pending and take those tokens from
        the last launch's samples on the device, where ``run_step`` writes them in (the
        host never waits for them)."""
        pending = [(row, seq.seq_id) for row, seq in enumerate(batch.seqs[:batch.num_decodes])
                   if seq.num_pending_tokens]
        if pending:
            seqs, token_ids = self._last_sampled
            rows_of = {seq.seq_id: row for row, seq in enumerate(seqs)}
            step.pending_rows = [row for row, _ in pending]
            step.pending_ids = token_ids[self._long([rows_of[seq_id] for _, seq_id in pending])]

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> torch.Tensor | None:
        """Put ``step`` on the device (its pending inputs filled in there), copy blocks, run
        the forward pass and project ``step.logit_rows`` through the LM head: their logits
        (on a tensor-parallel worker, None: the driver gathers them)."""
        step = step.on_device(self.device)
        if step.copies.numel():
            sources, destinations = step.copies
            self.kv_cache[:, :, destinations] = self.kv_cache[:, :, sources]
        hidden = self._forward(step.input_ids, step.positions, step.metadata)
        return self.model.compute_logits(hidden[step.logit_rows])

    def _prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor,
                         scored: ScoredPositions) -> dict[int, list[dict[int, float]]]:
        """Per ``(batch row, start, end)`` of ``scored``, the prompt log-probs of positions
        ``start`` to ``end``, whose logits are the next rows of ``logits``."""
        out: dict[int, list[dict[int, float]]] = {}
        first = 0
        for i, start, end in scored:
            seq = batch.seqs[i]
            targets = self._long(seq.token_ids[start + 1:end + 1])
            out[i] = self.sampler.prompt_logprobs(logits[first:first + end - start], targets,
                                                  seq.sampling_params.prompt_logprobs)
            first += end - start
        return out

    def _long(self, values: list) -> torch.Tensor:
        return long_tensor(values, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        graphs = self.graphs
        if graphs is not None and metadata.num_decodes == num_tokens and graphs.fits(num_tokens) \
                and not self.record_routing:  # the graphs keep no per-step routing
            return graphs.replay(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata)

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, int, ScoredPositions]:
        """The step's inputs, how many of its logit rows sample, and the prompt positions
        it scores (``InputBatch.prepare``)."""
        return self.input_batch.prepare(batch)

    def stats(self) -> dict[str, int | float]:
        """This rank's memory (``weight_bytes``, ``kv_cache_bytes``) and decode graphs: how
        many, how often captured, and the seconds and device bytes their last capture took."""
        return {
            "weight_bytes": self.weight_bytes(),
            "kv_cache_bytes": self.kv_cache_bytes(),
            "num_decode_graphs": len(self.graphs.graphs) if self.graphs else 0,
            "graph_captures": self.graph_captures,
            "graph_capture_seconds": self.graph_capture_seconds,
            "graph_bytes": self.graph_bytes,
        }


def check_exact_shapes(shape: KVShape) -> None:
    """Raise ValueError when the compiled attention, the only batch-invariant one, does not
    take this model's heads (``exact_logprobs`` would silently fall back otherwise)."""
    group = shape.num_heads // shape.num_kv_heads
    if shape.head_dim > MAX_HEAD_DIM or group > MAX_GROUP:
        raise ValueError(f"exact_logprobs: the CPU attention kernel takes heads up to "
                         f"{MAX_HEAD_DIM} wide in groups up to {MAX_GROUP}, not this model's "
                         f"({shape.head_dim}, {group}); set exact_logprobs=False.")
