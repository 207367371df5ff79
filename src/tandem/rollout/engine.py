"""``LLMEngine``: requests in, one scheduled step at a time, finished outputs out.

The server's loop and the trainers drive it directly; ``LLM.generate`` runs it to the end.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, ItemsView, Iterable
from collections.abc import Sequence as Seq

import torch
from transformers import AutoConfig

from tandem.sync import WeightUpdate

from . import sleep_mode
from .config import EngineConfig
from .core.block_manager import BlockManager
from .core.held import Continuation, HeldSequences
from .core.scheduler import Scheduler, SchedulerConfig
from .core.sequence import Request, Sequence
from .default_model import resolve_model
from .errors import EngineAsleepError
from .input_processor import (
    InputMethods,
    InputProcessor,
    ProcessedPrompt,
    Prompt,
    check_request_lists,
)
from .model_folder import eos_token_ids, load_tokenizer, resolve_max_model_len
from .output_processor import OutputProcessor, check_routing
from .outputs import RequestOutput, RoutingFormat
from .parallel.executor import make_runner
from .parallel.tensor_parallel import TensorParallel
from .sampling_params import SamplingParams
from .sleep_mode import STALE_WEIGHTS, SleepWakeSeconds
from .step_overlap import StepOverlap
from .structured_outputs import Grammar
from .worker.cpu_allocator import keep_freed_memory
from .worker.exact_forward import ExactForward
from .worker.memory import size_kv_cache
from .worker.models import model_class

EnginePrompt = Prompt | ProcessedPrompt | Continuation


class LLMEngine(InputMethods):
    """The engine core: a scheduler, a block manager and a model runner over one KV pool.

    Raises:
        ValueError: at start, for an unsupported architecture (listing the supported ones), a
            max_model_len beyond the model's, or a KV budget too small for one max-length
            sequence (naming the options that fix it).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model(config.model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        family = model_class(hf_config)  # refuses an unsupported architecture up front
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, hf_config, self.tokenizer)
        self.max_model_len = resolve_max_model_len(config, hf_config)
        device = config.torch_device
        dtype = config.torch_dtype(getattr(hf_config, "dtype", None))
        if device.type == "cpu" and config.tune_cpu_allocator:
            keep_freed_memory()
        worker = config.worker_config(model_dir, dtype, self.max_model_len, self.eos_token_ids,
                                      family.batch_invariant)
        self.runner = make_runner(worker, hf_config, config.tensor_parallel_size,
                                  config.distributed_executor_backend == "external_launcher")
        kv_size = size_kv_cache(config, hf_config, worker.kv_torch_dtype, self.max_model_len,
                                self.runner.weight_bytes(), self.runner.graph_sizes,
                                staging_bytes=self.runner.staging_bytes())
        self.num_kv_blocks = self.runner.agreed_num_blocks(kv_size.num_blocks)
        self.kv_groups = kv_size.groups
        self.memory_plan = kv_size.plan
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        self.runner.capture_graphs()
        self.steps = StepOverlap(self.runner, config.overlaps_steps)
        self.input_processor = InputProcessor(self.tokenizer, hf_config.vocab_size,
                                              self.max_model_len, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.runner.routing)
        self.requests: dict[str, Request] = {}
        self.weight_version = 0
        self.kv_blocks_used_peak = 0
        self.sleep_level = 0  # the deepest level since the last full wake_up (see sleep_mode)
        self.kv_cache_released = False
        self.weights = "resident"  # or, asleep, "offloaded" or "discarded"
        self.weights_stale = False  # discarded, and no full update since
        self.sleep_wake_seconds = SleepWakeSeconds()
        # Held by every step and by weight commits, so an update lands between steps, and by
        # every call that changes the requests or the pool, which a threaded commit may race.
        self.lock = threading.RLock()
        self._seq_ids = itertools.count()
        self.held = HeldSequences()  # outlives each pool: its blocks go, its tokens stay
        self.new_pool()

    def new_pool(self) -> None:
        """A fresh block manager and scheduler (at start and on waking); sequences a sleep
        preempted wait in it."""
        waiting = self.scheduler.waiting if hasattr(self, "scheduler") else ()
        self.block_manager = BlockManager(self.num_kv_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching,
                                          self.kv_groups.windows)
        self.block_manager.extra_key = (self.weight_version, None)
        self.scheduler = Scheduler(SchedulerConfig(
            self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
            self.runner.ops.attention.cascade), self.block_manager, self.eos_token_ids,
            self.output_processor.match_stop_string, self.held)
        self.scheduler.waiting.extend(waiting)

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of ``params.structured_outputs`` (None without one),
        compiled once per spec and cached (``InputProcessor.grammar``).

        Raises:
            ValueError: for a spec that does not compile.
        """
        return self.input_processor.grammar(params)

    @property
    def tensor_parallel(self) -> TensorParallel:
        """The runner's tensor-parallel group (size 1 without tensor parallelism)."""
        return self.runner.tp

    @property
    def routing_format(self) -> RoutingFormat | None:
        """How ``return_routed_experts`` encodes this model's routing (MoE layers, experts
        per token, dtype); None for a model without experts."""
        return self.runner.routing

    def add_request(self, request_id: str, prompt: EnginePrompt,
                    sampling_params: SamplingParams, hold_kv: bool = False) -> None:
        """Queue a prompt (text, ids, processed, or a ``Continuation``); its ``n`` sequences
        fork once it is prefilled. With ``hold_kv`` each finished completion keeps its KV
        blocks, held under ``(request_id, index)`` until continued or ``release``d.

        Raises:
            ValueError: for a duplicate request id (or, with ``hold_kv``, one whose earlier
                completions are still held), n above max_num_seqs, a prompt
                ``process_prompt`` refuses, a continuation of nothing held, or a
                ``structured_outputs`` that does not compile (nothing queued).
            EngineAsleepError: while the engine sleeps.
        """
        self.add_requests([request_id], [prompt], [sampling_params], hold_kv)

    def add_requests(self, request_ids: Seq[str], prompts: Seq[EnginePrompt],
                     params: Seq[SamplingParams], hold_kv: bool = False) -> None:
        """Queue several requests, all or none: every one is checked before any is queued.

        Raises:
            ValueError, EngineAsleepError: as ``add_request``, for any of them, and for
                lists of different lengths.
        """
        with self.lock:  # a threaded commit may be draining the scheduler
            self._add_requests(request_ids, prompts, params, hold_kv)

    def _add_requests(self, request_ids: Seq[str], prompts: Seq[EnginePrompt],
                      params: Seq[SamplingParams], hold_kv: bool) -> None:
        if self.is_sleeping:
            released = " and ".join(sorted(self.released))
            raise EngineAsleepError(f"the engine is asleep (its {released} released): call "
                                    "wake_up() before generating.")
        if self.weights_stale:
            raise EngineAsleepError(STALE_WEIGHTS)
        self._check_new_requests(request_ids, prompts, params, hold_kv)
        resolved = [self._resolve(prompt) for prompt in prompts]
        grammars = [self.compile_grammar(p) for p in params]
        continued = [held for _, held in resolved if held is not None]
        if len({id(seq) for seq in continued}) < len(continued):
            raise ValueError("one call continues a held completion twice: continue it once.")
        for request_id, (prompt, held), p, g in zip(request_ids, resolved, params, grammars):
            self._queue(Request(request_id, prompt.prompt, prompt.prompt_token_ids, p, g),
                        hold_kv, held)

    def _resolve(self, prompt: EnginePrompt) -> tuple[ProcessedPrompt, Sequence | None]:
        """The processed prompt, and for a continuation the held sequence it resumes."""
        if not isinstance(prompt, Continuation):
            return self.process_prompt(prompt), None
        held = self.held.available(prompt.key)
        return self.process_prompt(held.token_ids + list(prompt.token_ids)), held

    def release(self, request_id: str, index: int = 0) -> None:
        """Stop holding completion ``index`` of ``request_id`` and free its blocks.

        Raises:
            ValueError: when nothing is held under it, or a continuation claimed it.
        """
        with self.lock:
            self.scheduler.release_held(self.held.available((request_id, index)))

    def _check_new_requests(self, request_ids: Seq[str], prompts: Seq[EnginePrompt],
                            params: Seq[SamplingParams], hold_kv: bool) -> None:
        check_request_lists(request_ids, prompts, params, self.config.max_num_seqs)
        if any(p.return_routed_experts for p in params):
            check_routing(self.runner.routing, self.runner.model.config)
        for request_id in request_ids:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use.")
            if hold_kv and self.held.holds_request(request_id):
                raise ValueError(f"request id {request_id!r} still holds completions: "
                                 "continue or release them first, or use a new id.")

    def _queue(self, request: Request, hold_kv: bool, held: Sequence | None) -> None:
        first = request.make_sequences(self._seq_ids, hold_kv)
        if held is not None:
            self.held.claim(held)
            first.resume_from = held
        if not self.requests:
            self.kv_blocks_used_peak = 0
        self.requests[request.request_id] = request
        self.scheduler.add(first)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of the requests it finished. With
        overlapped steps (``step_overlap.py``) a step's outputs come from the next call.

        Raises:
            EngineAsleepError: while the engine sleeps with requests it kept.
        """
        if self.is_sleeping and self.requests:
            raise EngineAsleepError("the engine is asleep: call wake_up() before stepping.")
        with self.lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.kv_blocks_used_peak = max(self.kv_blocks_used_peak,
                                       self.block_manager.num_used_blocks)
        finished = self.steps.run(batch, self.scheduler, self.weight_version)
        request_ids = dict.fromkeys(seq.request_id for seq in finished)
        return [self._pop(r) for r in request_ids
                if r in self.requests and self.requests[r].is_finished]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks (a token of it still on the device, with
        overlapped steps, is dropped).

        Returns its output so far (unfinished completions with finish_reason "abort"), or
        None for an unknown or finished id.
        """
        with self.lock:  # a threaded commit may be draining the scheduler
            request = self.requests.pop(request_id, None)
            if request is None:
                return None
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                elif seq.hold_kv and self.steps.unreported(seq):
                    self.scheduler.release_held(seq)  # held unseen: none would release it
            return self.output_processor.make_output(request, self.weight_version)

    def request_output(self, request_id: str) -> RequestOutput:
        """The output so far of an unfinished request (``finished`` False), for streaming.

        Raises:
            KeyError: for an unknown or finished request id.
        """
        return self.output_processor.make_output(self.requests[request_id],
                                                 self.weight_version, finished=False)

    def num_output_tokens(self, request_id: str) -> int | None:
        """Tokens generated so far by a request's sequences (None: unknown or finished)."""
        request = self.requests.get(request_id)
        return None if request is None else request.num_output_tokens

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""
        return bool(self.requests)

    def waiting_request_ids(self) -> set[str]:
        """The ids of the requests with a sequence in the scheduler's waiting queue."""
        return {seq.request_id for seq in self.scheduler.waiting}

    def bind_thread(self) -> None:
        """Make the engine's device the calling thread's current CUDA device, as vLLM's
        worker does at start: every thread starts on device 0, so calls that name no
        device (a stream, an event, a capture's side stream) would go there. The engine's
        own threads call it (the core's loop, its threaded commands); an engine in a
        trainer's thread names its device in each call instead, leaving the trainer's
        current device alone. Nothing off CUDA."""
        device = self.config.torch_device
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def stats(self) -> dict[str, int | float]:
        """The engine's counters, each component's own (``ModelRunner.stats``,
        ``BlockManager.stats``, ``Scheduler.stats``) with the engine's.

        Memory held (and, when sized from a device share, the plan's parts as ``memory_*``),
        the decode graphs, the last sleep's and wake-up's seconds by part
        (``SleepWakeSeconds``), KV pool use (``kv_blocks_used_peak``: the most blocks held at
        once since the engine was last idle), queue lengths, weight version, prefix-cache
        hits, copy-on-write copies, preemptions, prefill tokens computed, decode steps and
        the sequences they decoded (since the pool was made) and held sequences.
        """
        plan = self.memory_plan.as_stats() if self.memory_plan else {}
        return plan | self.sleep_wake_seconds.as_stats() | self.runner.stats() \
            | self.block_manager.stats() | self.scheduler.stats() | {
                "sleep_level": self.sleep_level,
                "is_sleeping": int(self.is_sleeping),
                "kv_blocks_used_peak": self.kv_blocks_used_peak,
                "weight_version": self.weight_version,
                "held_sequences": len(self.held),
            }

    def exact_forward(self, model: torch.nn.Module, lora_runtime: bool = False,
                      shared_prefix: bool = True) -> ExactForward | None:
        """A forward pass of ``model`` (the trainer's copy of this engine's model) that gives
        the log-probs this engine samples with, bit for bit (``ExactForward``, each shared
        prefix once with ``shared_prefix``); None when the kernels are not batch-invariant
        (``exact_logprobs`` off) or split over ranks."""
        runner = self.runner
        if not runner.exact_logprobs or runner.tp.size > 1:
            return None
        return ExactForward(model, runner.model, runner.ops, lora_runtime, shared_prefix)

    def weight_update(self, version: int | None = None, full: bool = True,
                      alias: bool = False, copy: bool = True) -> WeightUpdate:
        """Begin a staged weight update (``tandem.sync.WeightUpdate``): ``load`` tensors, then
        ``commit`` or ``abort``; as a context manager it commits, or aborts on an exception.
        ``copy=False`` stages matching tensors by reference (unchanged until the commit).

        Raises:
            ValueError: for ``alias`` under ``exact_logprobs`` on CPU, whose panels are
                copies, or with ``quantization`` (the engine holds 8-bit codes, not the
                trainer's tensors)."""
        if alias and self.config.quantization is not None:
            raise ValueError(f"alias updates serve the trainer's tensors in place, which "
                             f"quantization={self.config.quantization!r} replaces by 8-bit "
                             "copies: update by copy (alias=False; the recipe's sync_alias: "
                             "false), or start the engine with quantization=None.")
        if alias and self.runner.exact_logprobs and self.runner.model.linear_layout == "panels":
            raise ValueError("alias updates serve the trainer's tensors in place, which the "
                             "batch-invariant panels of exact_logprobs cannot follow: start "
                             "the engine with exact_logprobs=False to alias, or copy.")
        return WeightUpdate(self, version, full, alias, copy)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = True,
                       alias: bool = False) -> int:
        """Load and commit an update in one call; returns the new weight version.

        A list, tuple or dict's items (no caller code runs between load and commit) is staged
        by reference where dtype and device match (``copy=False``); any other iterable is
        copied as read: a generator may change or free what it yielded once resumed (sharded
        gathers, TRL's PEFT unmerge). Pass ``list(generator)`` where its tensors stay put.

        Raises:
            WeightUpdateError: when a tensor is refused or a full update is incomplete; the
                engine keeps serving its previous weights.
        """
        copy = not isinstance(named_tensors, Seq | ItemsView)
        update = self.weight_update(version, full, alias, copy)
        update.load(named_tensors)
        return update.commit()

    def weight_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by Hugging Face name, in its full shape; a tied one under its
        first name (see ``ModelRunner.weight_parameters``)."""
        return self.runner.weight_parameters()

    def full_weight(self, name: str) -> torch.Tensor:
        """The current whole weight ``name`` (Hugging Face shape), under tensor parallelism
        gathered from the ranks' slices (what LoRA merging keeps as its base).

        Raises:
            EngineAsleepError: while the weights are discarded (``sleep(2)``).
        """
        if self.weights_stale:
            raise EngineAsleepError(STALE_WEIGHTS)
        with self.lock:
            return self.runner.full_weight(name)

    def unalias(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A tensor under another layout's name (a trainer's stacked experts) as the weight
        names and tensors (views) it holds, or None (``CausalLM.unalias``)."""
        return self.runner.model.unalias(name, tensor)

    def tied_parameter_names(self) -> set[str]:
        """Names that share another parameter's tensor (e.g. a tied ``lm_head.weight``)."""
        return self.runner.tied_parameter_names()

    def commit_weights(self, staged: dict[str, torch.Tensor], version: int, alias: bool) -> None:
        """Swap staged tensors in between steps; bump the version and the prefix-cache key.

        A copy keeps every parameter's storage, so the decode graphs stay valid; an alias
        that moves one to new storage recaptures them (see ``ModelRunner.commit_weights``).

        Raises:
            WeightUpdateError: when a tensor-parallel rank refuses its slice (no rank
                applies the update).
        """
        if self.weights == "discarded":
            raise EngineAsleepError("the weights' memory was released by sleep(level=2): "
                                    "call wake_up(tags=['weights']) before updating them.")
        with self.lock:
            self.steps.drain(self.scheduler)  # sampled under the old weights
            moved = self.runner.commit_weights(staged, alias)
            self._serve_version(version, None)
            if moved:
                self._recapture_graphs()
            if self.weights_stale and staged.keys() >= self.weight_parameters().keys():
                self.weights_stale = False

    def commit_lora(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                    version: int, lora_id: int) -> None:
        """Serve a run-time LoRA adapter from the next step on (replacing any earlier one).

        ``factors`` maps a weight name (``...q_proj.weight``) to ``(A, B, scale)`` (full
        factors; under tensor parallelism each rank takes its slice); modules left out serve
        their plain weights. The prefix-cache key takes the new version and ``lora_id``.

        Raises:
            ValueError: for a weight that is not a run-time-LoRA linear layer.
        """
        unknown = sorted(set(factors) - set(self.runner.lora_layers()))
        if unknown:
            raise ValueError(f"no run-time LoRA layer for {unknown[:3]}; adapters apply to the "
                             "q/k/v/o and gate/up/down projections.")
        with self.lock:
            self.steps.drain(self.scheduler)
            self.runner.set_lora(factors)
            self._serve_version(version, lora_id)
            self._recapture_graphs()  # the graphs were captured with or without adapters

    def recompute_unfinished(self) -> None:
        """Free the KV of every unfinished sequence; each recomputes its tokens when next
        scheduled (under the weights served then: the prefix cache keys on the version)."""
        with self.lock:
            self.steps.drain(self.scheduler)
            self.scheduler.preempt_all()

    def _serve_version(self, version: int, lora_id: int | None) -> None:
        """Serve new weights from the next step: held KV of the old ones is released (a
        continuation recomputes), and the prefix cache keys on the new version (blocks
        computed under the old weights are hashed under the old key first)."""
        self.scheduler.register_computed_blocks()
        self.weight_version = version
        self.block_manager.extra_key = (version, lora_id)
        self.scheduler.release_held_kv()

    @property
    def is_sleeping(self) -> bool:
        """True between a ``sleep`` (or ``release_kv_cache_memory``) and the ``wake_up``
        that restores everything."""
        return self.kv_cache_released or self.weights != "resident"

    @property
    def released(self) -> set[str]:
        """What sleeps, by vLLM's ``wake_up`` tags: ``"weights"``, ``"kv_cache"``."""
        return {tag for tag, out in (("weights", self.weights != "resident"),
                                     ("kv_cache", self.kv_cache_released)) if out}

    def sleep(self, level: int = 1, preempt: bool = False) -> None:
        """vLLM's sleep levels: 1 moves the weights to CPU and frees the KV pool; 2 discards
        both (the next update must be a full one: until then generating is refused). With
        ``preempt`` unfinished requests are kept: their KV is freed and they recompute
        after ``wake_up`` (partial rollouts carried across a step).

        Raises:
            ValueError: for a level but 1 or 2, or with requests unfinished (no ``preempt``).
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is invalid: use 1 (move the weights to CPU "
                             "and free the KV pool) or 2 (discard both; the next update "
                             "brings every weight back), or release_kv_cache_memory() to "
                             "free the KV pool alone.")
        sleep_mode.sleep(self, level, preempt)

    def release_kv_cache_memory(self, preempt: bool = False) -> None:
        """Free the KV pool alone, the weights staying where they are (vLLM's name): what a
        colocated trainer does between steps; ``wake_up`` restores it; ``preempt`` as in
        ``sleep``.

        Raises:
            ValueError: with requests unfinished (no ``preempt``).
        """
        sleep_mode.sleep(self, 0, preempt)

    def wake_up(self, tags: Collection[str] | None = None) -> None:
        """Restore what ``sleep`` released at the same addresses (the decode graphs stay
        valid, see ``graphs_current``): the weights, then the KV pool, empty. ``tags``
        (vLLM's) restores only ``"weights"`` and/or ``"kv_cache"`` (a trainer's peak first).

        Raises:
            ValueError: for an unknown tag.
        """
        sleep_mode.wake_up(self, tags)

    def _recapture_graphs(self) -> None:
        self.runner.drop_graphs()  # asleep, wake_up captures them once the pool is back
        if not self.is_sleeping:
            self.runner.capture_graphs()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block; later requests recompute their prompts."""
        with self.lock:  # a commit registers the blocks computed under the old weights
            self.block_manager.reset_prefix_cache()

    def _pop(self, request_id: str) -> RequestOutput:
        request = self.requests.pop(request_id)
        return self.output_processor.make_output(request, self.weight_version)
