"""Incremental detokenization against the tokenizer's own full decode, and stop strings
matched without decoding the whole output every step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.output_processor import IncrementalDetokenizer

from .conftest import build_tokenizer

TOKENIZER = build_tokenizer()


@settings(max_examples=60, deadline=None)
@given(token_ids=st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=40),
       skip_special_tokens=st.booleans(), chunk=st.integers(1, 4))
def test_incremental_text_equals_full_decode(token_ids, skip_special_tokens, chunk):
    detokenizer = IncrementalDetokenizer(TOKENIZER, skip_special_tokens)
    for end in range(0, len(token_ids) + chunk, chunk):
        detokenizer.update(token_ids[:end])
    full = TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(detokenizer.text)
    if not full.endswith("\ufffd"):  # else the tail waits for a character's other bytes
        assert detokenizer.text == full


def test_stop_found_across_the_searched_boundary():
    detokenizer = IncrementalDetokenizer(TOKENIZER, True)
    detokenizer.text = "the answer is 4"
    assert detokenizer.find_stop(["Answer:"]) is None
    detokenizer.text += "2. Answer: yes"
    assert detokenizer.find_stop(["yes", "Answer:"]) == "Answer:"


class DecodeSpy:
    """The tokenizer, recording how many tokens each ``decode`` call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_stop_strings_are_matched_on_a_few_new_tokens_per_step(llama_dir):
    llm = LLM(str(llama_dir))
    spy = DecodeSpy(AutoTokenizer.from_pretrained(llama_dir))
    llm.engine.output_processor.tokenizer = spy
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                            stop=["never appears \u2603"])
    output = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 48 and output.finish_reason == "length"
    per_step = spy.lengths[:-1]  # the last call decodes the final text, once
    # Decoding the whole output each step would pass 1 + 2 + ... + 48 = 1176 tokens; the
    # window grows only while a character's bytes are unfinished.
    assert len(per_step) >= 48 and sum(per_step) <= 6 * 48
    assert spy.lengths[-1] == 48
