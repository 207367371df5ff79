"""Structured outputs' cost: grpo-cpu with a small JSON schema on every request, beside the same
run unconstrained, in one engine and one process, the two alternating.

The workload is grpo_cpu.py's ``grpo`` (eight chat-templated arithmetic prompts, n=8, at most
64 new tokens, temperature 1) on the embedded SmolLM2-135M-Instruct in float32 with two
threads. The constrained run adds ``structured_outputs={"json": SCHEMA}`` to every request,
so each of the 64 sequences has its own xgrammar matcher, masked and advanced every step.
The figure is seconds per generated token (tokens through EOS), the median of ``--repeats``
timed calls each after one untimed warm-up per side, and the ratio constrained over
unconstrained (target: at most 1.10). Reading the tokenizer into xgrammar and compiling
the schema happen once, at the first constrained request; they are timed apart, on the
engine's own grammar cache before any generation, and are not in the ratio. The share of
the valid JSON outputs shows the constraint held (finished completions only).

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


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per side, alternating; the median is reported")
    return parser.parse_args()


def main() -> None:
    """Time both sides and print the table."""
    args = parse_args()
    setup_torch()
    folder = model_folder()
    work = build_workload(folder, "grpo", None)
    llm = LLM(str(folder), dtype="float32")
    spec = StructuredOutputsParams(json=SCHEMA)
    grammars = llm.engine.input_processor.grammars
    start = time.perf_counter()
    grammars.get(spec)
    first_compile = time.perf_counter() - start
    sides = {"unconstrained": None, "json schema": spec}
    runs: dict[str, list[Run]] = {name: [] for name in sides}
    valid: list[bool] = []
    for round_index in range(args.repeats + 1):
        for name, constraint in sides.items():
            params = SamplingParams(n=work.n, temperature=1.0, max_tokens=work.max_tokens,
                                    structured_outputs=constraint)
            llm.reset_prefix_cache()
            outputs, seconds, others = timed(
                lambda p=params: llm.generate(work.prompt_ids, p, use_tqdm=False))
            completions = [c for output in outputs for c in output.outputs]
            if constraint is not None:
                valid += [_is_valid(c.text) for c in completions if c.finish_reason == "stop"]
            if round_index:  # the first round warms both sides up
                lengths = [tokens_until_eos(c.token_ids, work.eos_token_id) for c in completions]
                runs[name].append(Run(lengths, seconds, others))
    medians = {name: sorted(r, key=lambda run: run.seconds / run.tokens)[(len(r) - 1) // 2]
               for name, r in runs.items()}
    reference = medians["unconstrained"]
    rows = [("run", "tokens", "seconds", "ms/token", "ratio", "tok/s", "others' CPU")]
    for name, run in medians.items():
        per_token = run.seconds / run.tokens
        rows.append((name, str(run.tokens), f"{run.seconds:.2f}", f"{per_token * 1e3:.2f}",
                     f"{per_token / (reference.seconds / reference.tokens):.3f}",
                     f"{run.tok_s:.1f}", f"{run.others_cpu:.0%}"))
    print(f"grpo-cpu, float32, {len(work.prompt_ids)} prompts x n={work.n}, "
          f"{work.max_tokens} tokens; median of {args.repeats} alternating calls per side")
    print_table(rows)
    print(f"first constrained request: {first_compile * 1e3:.0f} ms (xgrammar reading the "
          f"tokenizer {grammars.tokenizer_seconds * 1e3:.0f} ms, compiling the schema "
          f"{grammars.compile_seconds * 1e3:.0f} ms); later requests reuse the grammar")
    print(f"valid JSON among finished constrained completions: {sum(valid)}/{len(valid)}")


def _is_valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == {"answer", "confidence"} and isinstance(value["answer"], int)


if __name__ == "__main__":
    main()
