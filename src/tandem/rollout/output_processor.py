"""From sequences to ``RequestOutput``s: incremental detokenization and final text.

Stop strings are matched on text decoded incrementally: each step decodes only the newest
tokens (with a few before them for context), never the whole output again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from .core.sequence import Request, Sequence
from .outputs import CompletionOutput, RequestOutput, RoutingFormat


@dataclass(slots=True)
class IncrementalDetokenizer:
    """The text of one sequence's output, decoded a few tokens at a time.

    As vLLM's incremental detokenizer: ``new text = decode(ids[prefix_offset:]) minus
    decode(ids[prefix_offset:read_offset])``, where the tokens before ``read_offset`` give
    the context that decides spaces and merges; an unfinished UTF-8 character (decoded as
    U+FFFD) waits for the next token. ``searched`` is how much of ``text`` was already
    searched for stop strings.
    """

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    searched: int = 0

    def update(self, output_ids: list[int]) -> None:
        """Decode the tokens added since the last call (any number of them)."""
        if self.read_offset == len(output_ids):
            return
        prefix_text = self._decode(output_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(output_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)

    def find_stop(self, stops: list[str]) -> str | None:
        """The first of ``stops`` (by position) in the text not searched yet, with enough
        of the searched text before it to catch a stop string across the boundary."""
        start = max(self.searched - max(map(len, stops)) + 1, 0)
        region = self.text[start:]
        self.searched = len(self.text)
        found = [(region.find(stop), stop) for stop in stops if stop in region]
        return min(found)[1] if found else None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class OutputProcessor:
    """Matches stop strings as sequences grow and turns requests into outputs.

    Holds one ``IncrementalDetokenizer`` per sequence with stop strings, dropped when its
    request's final output is made.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None,
                 routing: RoutingFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.routing = routing
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}

    def match_stop_string(self, seq: Sequence) -> str | None:
        """The stop string ``seq``'s output text now holds (the earliest), or None."""
        if self.tokenizer is None:
            return None
        detokenizer = self.detokenizers.get(seq.seq_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer,
                                                 seq.sampling_params.skip_special_tokens)
            self.detokenizers[seq.seq_id] = detokenizer
        detokenizer.update(seq.output_token_ids)
        return detokenizer.find_stop(seq.sampling_params.stop)

    def make_output(self, request: Request, weight_version: int,
                    finished: bool = True) -> RequestOutput:
        """The ``RequestOutput`` of a request, completions in child order.

        ``finished`` False gives an unfinished request's output so far (for streaming);
        True also drops the request's detokenizers.
        """
        if finished:
            for seq in request.seqs:
                self.detokenizers.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[self._completion(seq) for seq in request.seqs],
            finished=finished,
            weight_version=max((s.token_weight_versions[-1] for s in request.seqs
                                if s.token_weight_versions), default=weight_version),
            prompt_logprobs=_prompt_logprobs(request))

    def _completion(self, seq: Sequence) -> CompletionOutput:
        params = seq.sampling_params
        wants_logprobs = params.logprobs is not None
        return CompletionOutput(
            index=seq.index, token_ids=seq.output_token_ids, text=self._final_text(seq),
            cumulative_logprob=sum(seq.logprobs) if seq.logprobs else None,
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            top_logprobs=list(seq.top_logprobs) if params.logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            weight_versions=seq.weight_versions,
            token_weight_versions=list(seq.token_weight_versions),
            sampling_thresholds=list(seq.sampling_thresholds) if params.truncates else None,
            routed_experts=self._routed_experts(seq) if seq.records_routing else None)

    def _routed_experts(self, seq: Sequence) -> torch.Tensor:
        """``[positions, moe layers, top_k]``: the experts of each position of the prompt
        and completion whose forward ran (all but the last token), from the chunks ``seq``
        computed and, before ``routing_inherited``, its ``routing_parent``'s (recursively:
        a continuation's earlier turns)."""
        layers, top_k, dtype = self.routing
        width = layers * top_k * dtype.itemsize
        rows = max(len(seq.token_ids) - 1, 0)
        buffer = bytearray(rows * width)
        for start, chunk, end in _routing_chunks(seq, rows):
            stop = min(start + len(chunk) // width, end)
            if stop > start:
                buffer[start * width:stop * width] = chunk[:(stop - start) * width]
        return torch.frombuffer(buffer, dtype=dtype).view(rows, layers, top_k) if rows \
            else torch.empty(0, layers, top_k, dtype=dtype)

    def _final_text(self, seq: Sequence) -> str:
        output = seq.output_token_ids
        keeps_stop = seq.sampling_params.include_stop_str_in_output
        if isinstance(seq.stop_reason, str):
            text = self._decode(seq, output)
            end = text.find(seq.stop_reason)
            if end < 0:
                return text
            return text[:end + len(seq.stop_reason)] if keeps_stop else text[:end]
        if seq.finish_reason == "stop" and output and not keeps_stop:
            output = output[:-1]  # the EOS or stop token
        return self._decode(seq, output)

    def _decode(self, seq: Sequence, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)


def _routing_chunks(seq: Sequence, end: int) -> list[tuple[int, bytes, int]]:
    """``(start, chunk, end)`` to write in order for ``seq``'s first ``end`` positions: its
    parent's chains first (up to what it inherited), then its own chunks."""
    chunks = []
    if seq.routing_parent is not None:
        chunks = _routing_chunks(seq.routing_parent, min(end, seq.routing_inherited))
    return chunks + [(start, chunk, end) for start, chunk in seq.routed_experts.items()]


def check_routing(routing: RoutingFormat | None, config: object) -> None:
    """Refuse ``return_routed_experts`` on a model without experts.

    Raises:
        ValueError: naming the fix.
    """
    if routing is None:
        names = getattr(config, "architectures", None) or [type(config).__name__]
        raise ValueError(f"return_routed_experts needs a mixture-of-experts model; "
                         f"{names[0]} has no experts: leave it False.")


def _prompt_logprobs(request: Request) -> list[dict[int, float] | None] | None:
    if request.sampling_params.prompt_logprobs is None:
        return None
    return [None, *request.seqs[0].prompt_logprobs]
