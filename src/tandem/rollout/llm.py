"""``LLM``: the offline, vLLM-shaped entry point (``generate``, ``chat``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from tandem.sync import WeightUpdate

from .config import EngineConfig
from .core.held import Continuation
from .engine import LLMEngine
from .input_processor import Prompt
from .outputs import RequestOutput, RoutingFormat
from .parallel.tensor_parallel import TensorParallel
from .sampling_params import SamplingParams
from .structured_outputs import Grammar
from .worker.exact_forward import ExactForward

Conversation = list[dict[str, str]]
LLMPrompt = Prompt | Continuation


class LLM:
    """A rollout engine on one device, driven to completion by ``generate``.

    Keyword arguments are ``EngineConfig``'s fields (vLLM's names), its defaults the only
    ones: ``model`` is a local Hugging Face folder or ``"smollm2-135m-instruct"``, the
    embedded default.

    Raises:
        TypeError: for an argument ``EngineConfig`` does not have.
        ValueError: when the configuration cannot work (see ``EngineConfig`` and
            ``LLMEngine``).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **_config_fields(engine_args)))
        self._request_ids = itertools.count()
        self._finished: dict[str, RequestOutput] = {}  # finished while another call stepped

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (None when the folder has none)."""
        return self.engine.tokenizer

    def generate(self, prompts: LLMPrompt | Seq[LLMPrompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, hold_kv: bool = False) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts, in input order.

        A prompt is a string, a list of token ids, or a ``Continuation`` of a held
        completion. ``sampling_params`` is one for all prompts or one per prompt (default:
        ``SamplingParams()``). With ``hold_kv`` every completion keeps its KV blocks for a
        later turn: continue it with ``Continuation(output.request_id, completion.index,
        new_token_ids)``, or ``release`` it.

        Raises:
            ValueError: for any invalid prompt or parameter list, before anything is queued.
        """
        request_ids = self._add(prompts, sampling_params, hold_kv)
        outputs = {}
        with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as bar:
            for output in self._as_completed(request_ids):
                outputs[output.request_id] = output
                bar.update(1)
        return [outputs[request_id] for request_id in request_ids]

    def generate_as_completed(self, prompts: LLMPrompt | Seq[LLMPrompt],
                              sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                              hold_kv: bool = False) -> Iterator[RequestOutput]:
        """Generate as ``generate`` does, but yield each request's output (a group of its
        ``n`` completions) the moment its last completion ends, in the order they finish.

        The engine steps only while the iterator is advanced, so work done between two
        outputs (scoring a group's rewards) runs on the caller's thread between engine
        steps. Closing the iterator early aborts the requests still running.

        Raises:
            ValueError: as ``generate``, at the call (before anything is queued).
        """
        return self._as_completed(self._add(prompts, sampling_params, hold_kv))

    def release(self, request_id: str, index: int = 0) -> None:
        """Free the KV blocks a held completion keeps (see ``generate``'s ``hold_kv``).

        Raises:
            ValueError: when nothing is held under it, or a continuation claimed it.
        """
        self.engine.release(request_id, index)

    def chat(self, conversations: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate from its token ids.

        The template supplies the special tokens (nothing is added on top). A conversation
        is a list of ``{"role": ..., "content": ...}`` messages; ``tools`` (OpenAI's
        function dicts) are rendered by the template for every conversation. As vLLM's:
        ``continue_final_message`` leaves each conversation's last message open, so the
        completion continues it (pass ``add_generation_prompt=False`` with it), and
        ``chat_template_kwargs`` are further variables the template reads (such as Qwen 3's
        ``enable_thinking``).

        Raises:
            ValueError: as ``InputProcessor.apply_chat_template``: no tokenizer or chat
                template, a template that ignores ``tools``, both ``add_generation_prompt``
                and ``continue_final_message``, a reserved ``chat_template_kwargs`` key.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.engine.apply_chat_template(
            c, add_generation_prompt, tools, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @property
    def weight_version(self) -> int:
        """The version of the weights being served (0 until the first update)."""
        return self.engine.weight_version

    @property
    def is_sleeping(self) -> bool:
        """True between ``sleep`` (or ``release_kv_cache_memory``) and the ``wake_up`` that
        restores everything."""
        return self.engine.is_sleeping

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus completion) the engine takes."""
        return self.engine.max_model_len

    def exact_forward(self, model: torch.nn.Module, lora_runtime: bool = False,
                      shared_prefix: bool = True) -> ExactForward | None:
        """A forward pass of ``model`` (the trainer's copy of this engine's model, maybe a
        peft one) that gives the log-probs this engine samples with, bit for bit
        (``exact_forward.py``); its adapter as this engine gets it, merged, or added at run
        time with ``lora_runtime``; each row's prefix shared with the row before computed
        once unless ``shared_prefix`` is False (the same bits). None when the engine's
        kernels are not batch-invariant (``exact_logprobs`` off) or it is split over
        ranks."""
        return self.engine.exact_forward(model, lora_runtime, shared_prefix)

    @property
    def tensor_parallel(self) -> TensorParallel:
        """The engine's tensor-parallel group (size 1 without tensor parallelism)."""
        return self.engine.tensor_parallel

    @property
    def routing_format(self) -> RoutingFormat | None:
        """How ``return_routed_experts`` encodes this model's routing; None for a model
        without experts (see ``LLMEngine.routing_format``)."""
        return self.engine.routing_format

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of ``params.structured_outputs`` (None without one), as
        the engine masks with it (see ``LLMEngine.compile_grammar``)."""
        return self.engine.compile_grammar(params)

    def stats(self) -> dict[str, int | float]:
        """The engine's counters (see ``LLMEngine.stats``)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block."""
        self.engine.reset_prefix_cache()

    def weight_update(self, version: int | None = None, full: bool = True,
                      alias: bool = False, copy: bool = True) -> WeightUpdate:
        """Begin a staged weight update (``load`` any number of times, then ``commit``).

        ``with llm.weight_update() as update: update.load(named_tensors)`` commits on exit
        and aborts on an exception. Each loaded tensor is copied as it is loaded;
        ``copy=False`` stages one already in the engine's dtype on its device by reference
        (the caller keeps it unchanged until the commit).
        """
        return self.engine.weight_update(version, full, alias, copy)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = True,
                       alias: bool = False) -> int:
        """Push new weights (Hugging Face or trainer-wrapped names) in one call.

        A full update (the default) must carry every parameter. Returns the new weight
        version. Raises ``WeightUpdateError`` on a refused tensor; the old weights keep
        serving. Tensors given as a list, a tuple or a dict's items are not copied before
        the commit; a generator's are (see ``LLMEngine.update_weights``).
        """
        return self.engine.update_weights(named_tensors, version, full, alias)

    def sleep(self, level: int = 1, preempt: bool = False) -> None:
        """vLLM's levels: 1 moves the weights to CPU and frees the KV pool, 2 discards both
        (push every weight before generating again) while the trainer steps (``preempt``:
        keep unfinished requests, recomputed after ``wake_up``)."""
        self.engine.sleep(level, preempt)

    def release_kv_cache_memory(self, preempt: bool = False) -> None:
        """Free the KV pool alone (the weights stay) until ``wake_up`` (vLLM's name)."""
        self.engine.release_kv_cache_memory(preempt)

    def wake_up(self, tags: Collection[str] | None = None) -> None:
        """Restore the weights and a fresh KV pool after ``sleep`` (``tags``: only some)."""
        self.engine.wake_up(tags)

    def _add(self, prompts: LLMPrompt | Seq[LLMPrompt],
             sampling_params: SamplingParams | Seq[SamplingParams] | None,
             hold_kv: bool) -> list[str]:
        prompt_list = as_prompt_list(prompts)
        params = params_per_prompt(sampling_params, len(prompt_list))
        request_ids = [f"llm-{next(self._request_ids)}" for _ in prompt_list]
        self.engine.add_requests(request_ids, prompt_list, params, hold_kv)
        return request_ids

    def _as_completed(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until every one of ``request_ids`` has finished, yielding each
        as it does; another call's outputs are kept for it. Aborts the rest on exit."""
        pending = set(request_ids)
        try:
            while pending:
                for request_id in [r for r in self._finished if r in pending]:
                    pending.discard(request_id)
                    yield self._finished.pop(request_id)
                for output in self.engine.step() if pending else ():
                    self._finished[output.request_id] = output
        finally:
            for request_id in pending:
                self.engine.abort_request(request_id)


def _config_fields(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``engine_args`` checked against ``EngineConfig``'s fields (the one list of defaults).

    Raises:
        TypeError: for an argument that is not an ``EngineConfig`` field, naming the valid ones.
    """
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(engine_args) - names)
    if unknown:
        raise TypeError(f"LLM got unknown arguments {unknown}: the engine takes "
                        f"{', '.join(sorted(names))} (see EngineConfig).")
    return engine_args


def as_prompt_list(prompts: LLMPrompt | Seq[LLMPrompt]) -> list[LLMPrompt]:
    """One prompt (text, token ids or a continuation) or a list of them, as a list.

    Raises:
        ValueError: for an empty list.
    """
    if isinstance(prompts, str | Continuation):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("no prompts given.")
    return prompts


def params_per_prompt(params: SamplingParams | Seq[SamplingParams] | None,
                      num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt, from one for all (default ``SamplingParams()``) or
    one each.

    Raises:
        ValueError: when a list's length differs from the number of prompts.
    """
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts: pass one "
                         "for all or one per prompt.")
    return params
