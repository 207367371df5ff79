"""Structured outputs with xgrammar: every completion matches its JSON schema, regex, choice or
grammar; log-probs are those of the masked distribution; bad specs are refused up front."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
import xgrammar
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tandem.rollout import LLM, Continuation, SamplingParams, structured_outputs
from tandem.rollout.structured_outputs import (
    StructuredOutputsParams,
    apply_grammar_masks,
    grammar_bitmasks,
    unpack_bitmask,
)

from .conftest import SMALL, build_tokenizer

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "size", "count"], "additionalProperties": False}
PADDING = 40  # the model's vocabulary is the tokenizer's plus unused rows, as LM heads pad


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    """A tiny Llama whose vocabulary (LM head rows) exceeds its tokenizer's."""
    path = tmp_path_factory.mktemp("padded")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer) + PADDING, tie_word_embeddings=False, **SMALL)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make the padded rows the likeliest, so only the mask keeps them out
        model.lm_head.weight[len(tokenizer):] = model.lm_head.weight[:PADDING].abs() * 50
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(padded_dir) -> LLM:
    return LLM(str(padded_dir), num_kv_blocks=64, max_model_len=256, seed=3)


def sample(llm: LLM, spec: dict, n: int = 8, max_tokens: int = 64, **kwargs):
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=1, logprobs=0,
                            structured_outputs=StructuredOutputsParams(**spec), **kwargs)
    return llm.generate(["Answer in JSON:", [5, 6, 7]], params, use_tqdm=False)


def test_every_completion_validates_against_its_json_schema(llm):
    outputs = sample(llm, dict(json=SCHEMA, disable_any_whitespace=True))
    completions = [c for output in outputs for c in output.outputs]
    assert all(c.finish_reason == "stop" for c in completions)
    texts = {c.text for c in completions}
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(texts) > 1  # each member of a group has its own matcher and its own draws
    vocab = len(build_tokenizer())
    assert all(t < vocab for c in completions for t in c.token_ids)


@pytest.mark.parametrize("spec, check", [
    (dict(regex=r"[0-9]{2,4}-[a-c]+"), lambda t: re.fullmatch(r"[0-9]{2,4}-[a-c]+", t)),
    (dict(choice=["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
    (dict(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
     lambda t: re.fullmatch(r"\(\d+(,\d+)*\)", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(llm, spec, check):
    completions = [c for o in sample(llm, spec, max_tokens=96) for c in o.outputs]
    finished = [c for c in completions if c.finish_reason == "stop"]
    assert len(finished) >= len(completions) // 2
    assert all(check(c.text) for c in finished), [c.text for c in finished]


def test_logprobs_are_those_of_the_masked_distribution(llm, padded_dir):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outputs = sample(llm, dict(json=SCHEMA, disable_any_whitespace=True), n=3)
    grammar = llm.engine.input_processor.grammars.get(spec)
    reference = AutoModelForCausalLM.from_pretrained(padded_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(padded_dir)
    for output, prompt in zip(outputs, ["Answer in JSON:", [5, 6, 7]]):
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        for completion in output.outputs:
            ids = torch.tensor([prompt_ids + completion.token_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(prompt_ids) - 1:-1].float()
            masks = grammar_bitmasks(grammar, [completion.token_ids], len(completion.token_ids))
            allowed = unpack_bitmask(masks[0], logits.shape[-1])
            expected = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            chosen = expected.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
            assert torch.allclose(chosen, torch.tensor(completion.logprobs), atol=1e-4)
            plain = torch.log_softmax(logits, dim=-1).gather(
                1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
            assert (plain - chosen).abs().max() > 1e-2  # the mask did change the distribution


def test_the_mask_covers_the_padded_vocabulary():
    class Row:
        def __init__(self, matcher):
            self.matcher = matcher

    tokenizer = build_tokenizer()
    cache = structured_outputs.GrammarCache(tokenizer, len(tokenizer) + PADDING,
                                            [tokenizer.eos_token_id])
    grammar = cache.get(StructuredOutputsParams(choice=["ab"]))
    logits = torch.zeros(2, len(tokenizer) + PADDING)
    logits[:, -1] = 100.0
    apply_grammar_masks(logits, [Row(grammar.matcher()), Row(None)])
    assert logits[0, len(tokenizer):].eq(float("-inf")).all()
    assert logits[1].isfinite().all()  # an unconstrained row is left alone


def test_greedy_is_the_masked_argmax_and_survives_preemption(llm):
    spec = StructuredOutputsParams(regex=r"[a-z]{3,40}")
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=spec)
    expected = llm.generate([[9, 10, 11]], params, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    engine.add_request("preempted", [9, 10, 11], params)
    for _ in range(4):
        engine.step()
    engine.recompute_unfinished()  # the sequence recomputes its tokens; its matcher stays
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert finished[0].outputs[0].token_ids == expected.token_ids
    assert re.fullmatch(r"[a-z]{3,40}", expected.text)


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    outputs = sample(llm, dict(regex="a{200}"), n=2, max_tokens=5)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5
               for o in outputs for c in o.outputs)


def test_ignore_eos_and_min_tokens_yield_to_the_grammar(llm):
    outputs = sample(llm, dict(choice=["no"]), n=2, max_tokens=20, ignore_eos=True,
                     min_tokens=10)
    assert all(c.text == "no" and c.finish_reason == "stop" for o in outputs for c in o.outputs)


@pytest.mark.parametrize("spec, match", [
    (dict(regex="(("), "structured_outputs.regex is invalid: Regex parsing error"),
    (dict(json={"type": "nope"}), "structured_outputs.json is invalid"),
    (dict(json="{not json"), "structured_outputs.json is invalid"),
    (dict(grammar="root ::= "), "structured_outputs.grammar is invalid: EBNF parser error"),
])
def test_an_invalid_spec_is_refused_before_anything_is_queued(llm, spec, match):
    good = SamplingParams(max_tokens=2)
    bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=re.escape(match)):
        llm.generate([[5, 6], [7, 8]], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["num_waiting"] == 0
    assert len(llm.generate([[5, 6]], good, use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("fields, match", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "non-empty list"),
    (dict(regex=3), "wrong type"),
])
def test_bad_params_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_refuse_unknown_fields():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="fields are those of StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regexp": "a+"})


def test_each_distinct_spec_compiles_once(llm, monkeypatch):
    calls = []
    compile_ = structured_outputs._compile
    monkeypatch.setattr(structured_outputs, "_compile",
                        lambda compiler, params: calls.append(params) or compile_(compiler, params))
    llm.engine.input_processor.grammars._grammars.clear()
    for pattern in ("x[0-9]", "x[0-9]", "y[0-9]"):
        sample(llm, dict(regex=pattern), n=2, max_tokens=4)
    # The trainer's replay (LLM.compile_grammar) gets the grammar the engine masked with.
    assert llm.compile_grammar(SamplingParams()) is None
    assert llm.compile_grammar(SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="x[0-9]"))) is not None
    assert [p.regex for p in calls] == ["x[0-9]", "y[0-9]"]


def test_a_tokenizer_xgrammar_cannot_read_is_refused_at_the_request(padded_dir, monkeypatch):
    def unreadable(*args, **kwargs):
        raise RuntimeError("unsupported vocabulary type")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", unreadable)
    llm = LLM(str(padded_dir), num_kv_blocks=16, max_model_len=64)  # starts all the same
    with pytest.raises(ValueError, match="xgrammar cannot read its tokenizer"):
        sample(llm, dict(regex="a"), n=1)
    plain = llm.generate([[5, 6]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(plain[0].outputs[0].token_ids) == 3


def test_a_continuation_starts_its_own_matcher(llm):
    spec = StructuredOutputsParams(choice=["red", "blue"])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=4, structured_outputs=spec)
    first = llm.generate([[5, 6, 7]], params, use_tqdm=False, hold_kv=True)[0]
    assert {c.text for c in first.outputs} <= {"red", "blue"}
    # The next turn's constraint matches its own new tokens, not the held completion's.
    turn = SamplingParams(temperature=1.0, max_tokens=8, seed=4,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
    outputs = llm.generate([Continuation(first.request_id, i, [9, 10]) for i in range(2)],
                           turn, use_tqdm=False)
    assert all(re.fullmatch("[0-9]{2}", o.outputs[0].text) for o in outputs)
    assert llm.stats()["kv_blocks_used"] == 0


ECOSYSTEM = ("xgrammar", "prometheus_client", "datasets", "math_verify", "trl", "wandb")


def test_the_engine_runs_without_the_ecosystem_extras(llama_dir):
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in ECOSYSTEM)
    script = "import sys\n" + blocked + f"""
import tandem.sync, tandem.kernels, tandem.trainers
from tandem.rollout import LLM, SamplingParams
llm = LLM({str(llama_dir)!r}, num_kv_blocks=16, max_model_len=64)
assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3
try:
    llm.generate([[5, 6]], SamplingParams(structured_outputs={{"regex": "a"}}))
except ValueError as exc:
    assert "pip install 'tandem-rollout[structured]'" in str(exc), exc
else:
    raise AssertionError("a constrained request without xgrammar was not refused")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
