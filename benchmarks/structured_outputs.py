"""Structured outputs' cost: grpo-cpu with a small JSON schema on every request, beside the same
run unconstrained, in one engine and one process, the sides alternating.

The workload is grpo_cpu.py's ``grpo`` (eight chat-templated arithmetic prompts, n=8, at most
64 new tokens, temperature 1) on the embedded SmolLM2-135M-Instruct in float32 with two
threads. A constrained side adds ``structured_outputs={"json": schema}`` to every request,
so each of the 64 sequences has its own xgrammar matcher, masked and advanced every step.
The figure is seconds per generated token (tokens through EOS), the median of ``--repeats``
timed calls each after one untimed warm-up per side, and its ratio to the unconstrained
side of the same pair (target: at most 1.10):

- ``equal length``: ``LONG_SCHEMA`` (an object holding an array of at least 64 small
  integers) cannot finish in 64 tokens, and the unconstrained side ignores EOS, so every
  sequence of both sides generates exactly 64 tokens and the ratio is the constraint's own
  cost per token;
- ``natural``: ``SCHEMA`` (an answer and a confidence) against plain sampling, both ending
  at EOS: the constrained completions are shorter, so each call's fixed costs (the
  prefill) weigh more per token and the ratio overstates the constraint's cost.

Reading the tokenizer into xgrammar and compiling a schema happen once, at the first
constrained request; they are timed apart, on the engine's own grammar cache before any
generation, and are in no ratio. The share of valid JSON among the natural side's finished
completions shows the constraint held.

    python benchmarks/structured_outputs.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

from common import Run, model_folder, print_table, setup_torch, timed, tokens_until_eos
from grpo_cpu import build_workload

from tandem.rollout import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer"}, "confidence": {"enum": ["low", "medium", "high"]}},
    "required": ["answer", "confidence"], "additionalProperties": False}
LONG_SCHEMA = {"type": "object", "properties": {"steps": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 64}}, "required": ["steps"], "additionalProperties": False}
# (pair, side, constraint, ignore_eos)
SIDES = (("equal length", "unconstrained", None, True),
         ("equal length", "long json schema", LONG_SCHEMA, False),
         ("natural", "unconstrained", None, False),
         ("natural", "json schema", SCHEMA, False))


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per side, alternating; the median is reported")
    return parser.parse_args()


def main() -> None:
    """Time every side and print the table."""
    args = parse_args()
    setup_torch()
    folder = model_folder()
    work = build_workload(folder, "grpo", None)
    llm = LLM(str(folder), dtype="float32")
    grammars = llm.engine.input_processor.grammars
    compile_ms = {}
    for name, schema in (("schema", SCHEMA), ("long schema", LONG_SCHEMA)):
        start = time.perf_counter()
        grammars.get(StructuredOutputsParams(json=schema))
        compile_ms[name] = (time.perf_counter() - start) * 1e3
    runs: dict[tuple[str, str], list[Run]] = {side[:2]: [] for side in SIDES}
    valid: list[bool] = []
    for round_index in range(args.repeats + 1):
        for pair, side, schema, ignore_eos in SIDES:
            completions, run = generate(llm, work, schema, ignore_eos)
            if schema is SCHEMA:
                valid += [_is_valid(c.text) for c in completions if c.finish_reason == "stop"]
            if round_index:  # the first round warms every side up
                runs[pair, side].append(run)
    print(f"grpo-cpu, float32, {len(work.prompt_ids)} prompts x n={work.n}, "
          f"{work.max_tokens} tokens; median of {args.repeats} alternating calls per side")
    print_table(table(runs))
    print(f"first constrained request: {compile_ms['schema']:.0f} ms (xgrammar reading the "
          f"tokenizer {grammars.tokenizer_seconds * 1e3:.0f} ms, importing xgrammar and "
          f"compiling); the long schema then compiled in {compile_ms['long schema']:.1f} ms; "
          "later requests reuse the grammar")
    print(f"valid JSON among the natural side's finished completions: {sum(valid)}/{len(valid)}")


def generate(llm: LLM, work, schema: dict | None, ignore_eos: bool) -> tuple[list, Run]:
    """One timed call of the workload (prefix cache reset): its completions and its run."""
    params = SamplingParams(n=work.n, temperature=1.0, max_tokens=work.max_tokens,
                            ignore_eos=ignore_eos, structured_outputs=None if schema is None
                            else StructuredOutputsParams(json=schema))
    llm.reset_prefix_cache()
    outputs, seconds, others = timed(
        lambda: llm.generate(work.prompt_ids, params, use_tqdm=False))
    completions = [c for output in outputs for c in output.outputs]
    lengths = [len(c.token_ids) if ignore_eos else tokens_until_eos(c.token_ids, work.eos_token_id)
               for c in completions]
    return completions, Run(lengths, seconds, others)


def table(runs: dict[tuple[str, str], list[Run]]) -> list[tuple[str, ...]]:
    """The median run of each side, and its per-token ratio to its pair's unconstrained."""
    medians = {key: sorted(r, key=lambda run: run.seconds / run.tokens)[(len(r) - 1) // 2]
               for key, r in runs.items()}
    rows = [("pair", "side", "tokens", "seconds", "ms/token", "ratio", "tok/s", "others' CPU")]
    for (pair, side), run in medians.items():
        reference = medians[pair, "unconstrained"]
        per_token = run.seconds / run.tokens
        rows.append((pair, side, str(run.tokens), f"{run.seconds:.2f}",
                     f"{per_token * 1e3:.2f}",
                     f"{per_token / (reference.seconds / reference.tokens):.3f}",
                     f"{run.tok_s:.1f}", f"{run.others_cpu:.0%}"))
    return rows


def _is_valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == {"answer", "confidence"} and isinstance(value["answer"], int)


if __name__ == "__main__":
    main()
