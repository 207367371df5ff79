"""Base rate of tool calls on the embedded model: the ``calculator`` task's episodes, with and
without the worked example its prompt carries, before any training.

64 episodes (16 products x n=4, temperature 0.8, seed 0, at most 48 tokens a turn, 3 turns)
on SmolLM2-135M-Instruct in float32, 2 threads. Prints, per prompt, the tool calls made,
those answered without an error, and the fraction of final answers that are correct.
"""

from __future__ import annotations

from common import model_folder, print_table, setup_torch
from transformers import AutoTokenizer

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.episodes import EpisodeRunner
from tandem.trainers.tasks import CALCULATOR_SHOT, build_task

NUM_EXAMPLES, GROUP = 16, 4


def base_rate(llm: LLM, tokenizer, with_example: bool) -> tuple[str, ...]:
    task = build_task("calculator")
    examples = [task.train_example(0, i) for i in range(NUM_EXAMPLES)]
    if not with_example:
        examples = [{**e, "prompt": e["prompt"][len(CALCULATOR_SHOT):]} for e in examples]
    params = SamplingParams(n=GROUP, temperature=0.8, max_tokens=48, seed=0)
    groups = EpisodeRunner(llm.engine, tokenizer, params, max_turns=3).run(examples,
                                                                         task.environment)
    episodes = [t for group in groups for t in group]
    calls = sum(t.metrics.get("tool_calls", 0.0) for t in episodes)
    errors = sum(t.metrics.get("tool_errors", 0.0) for t in episodes)
    correct = task.rewards["correct"]([t.messages[t.num_prompt_messages:] for t in episodes],
                                      answer=[e["answer"] for e in examples for _ in range(GROUP)])
    return ("with the worked example" if with_example else "system prompt only",
            str(len(episodes)), f"{calls:.0f}", f"{calls - errors:.0f}",
            f"{sum(correct) / len(episodes):.3f}")


def main() -> None:
    setup_torch()
    folder = model_folder()
    llm = LLM(str(folder), kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = [("prompt", "episodes", "tool calls", "answered", "correct")]
    rows += [base_rate(llm, tokenizer, with_example) for with_example in (False, True)]
    print_table(rows)


if __name__ == "__main__":
    main()
