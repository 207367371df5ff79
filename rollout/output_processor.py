"""Stop conditions and detokenisation: from sampled tokens to ``RequestOutput``s."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .outputs import CompletionOutput, RequestOutput
from .sequence import Request, Sequence


class OutputProcessor:
    """Decides when a sequence stops and turns finished requests into outputs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_stop(self, seq: Sequence) -> str | None:
        """The finish reason if ``seq``'s newest token ends it ("stop" or "length"), else None.

        Sets ``seq.stop_reason`` to the stop token id or stop string that matched.
        """
        params = seq.sampling_params
        token = seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            matched = self._matched_stop_string(seq) if params.stop else None
            if matched is not None:
                seq.stop_reason = matched
                return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def make_output(self, request: Request, weight_version: int) -> RequestOutput:
        """The ``RequestOutput`` of a finished request, completions in child order."""
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[self._completion(seq) for seq in request.seqs],
            weight_version=max((s.last_weight_version or 0 for s in request.seqs),
                               default=weight_version))

    def _completion(self, seq: Sequence) -> CompletionOutput:
        params = seq.sampling_params
        wants_logprobs = params.logprobs is not None
        versions = None
        if seq.first_weight_version is not None:
            versions = (seq.first_weight_version, seq.last_weight_version)
        return CompletionOutput(
            index=seq.index, token_ids=seq.output_token_ids, text=self._final_text(seq),
            cumulative_logprob=sum(seq.logprobs) if seq.logprobs else None,
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            top_logprobs=list(seq.top_logprobs) if params.logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            weight_versions=versions)

    def _final_text(self, seq: Sequence) -> str:
        output = seq.output_token_ids
        if isinstance(seq.stop_reason, str):
            text = self._decode(seq, output)
            return text[:text.find(seq.stop_reason)]
        if seq.finish_reason == "stop" and output:
            output = output[:-1]  # the EOS or stop token
        return self._decode(seq, output)

    def _matched_stop_string(self, seq: Sequence) -> str | None:
        text = self._decode(seq, seq.output_token_ids)
        found = [(text.find(stop), stop) for stop in seq.sampling_params.stop if stop in text]
        return min(found)[1] if found else None

    def _decode(self, seq: Sequence, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)
