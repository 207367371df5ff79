"""Multi-turn episodes: prefill tokens and seconds per turn with the KV kept between turns
(``hold_kv`` and ``Continuation``), against re-sending the whole conversation each turn.

Workload (the multi-turn issue's): 32 episodes of 4 turns on the embedded
SmolLM2-135M-Instruct, float32, 2 threads, greedy, 16 new tokens per model turn; between
turns each episode receives 16 environment tokens (fixed ids, as a tool's answer would be
after tokenization). Three ways, each in a fresh engine, every episode stepping in lockstep:

- ``kept``: each turn continues the held completion with the environment's tokens;
- ``resend, prefix cache``: each turn sends the whole conversation as a new prompt (what an
  agent framework that re-sends ids gets, TRL's tool loop included): only the full blocks
  cached from earlier turns are skipped;
- ``resend, no cache``: the same with prefix caching off (the whole history recomputed).

Per turn: prefill tokens computed (the engine's ``prefill_tokens``), and the seconds of the
generation call. The kept path computes each turn's new tokens plus the previous turn's last
sampled token; the target is within one block of the new tokens.
"""

from __future__ import annotations

import argparse
import time

from common import chat_prompt_ids, model_folder, print_table, setup_torch
from transformers import AutoTokenizer

from tandem.rollout import LLM, Continuation, SamplingParams

NUM_EPISODES, NUM_TURNS, TURN_TOKENS, ENV_TOKENS = 32, 4, 16, 16
PARAMS = SamplingParams(temperature=0, max_tokens=TURN_TOKENS, ignore_eos=True)


def environment_tokens(episode: int, turn: int) -> list[int]:
    """The environment's answer: fixed ids that differ per episode and turn."""
    return [1000 + (37 * episode + 11 * turn + i) % 5000 for i in range(ENV_TOKENS)]


def kept(llm: LLM, prompts: list[list[int]]) -> list[tuple[int, float]]:
    """Per turn: (prefill tokens, seconds) when every turn continues the held completion
    (the last turn holds nothing, so the pool ends empty)."""
    turns, outputs = [], None
    for turn in range(NUM_TURNS):
        if outputs is None:
            requests = prompts
        else:
            requests = [Continuation(o.request_id, 0, environment_tokens(e, turn))
                        for e, o in enumerate(outputs)]
        turns.append(timed_turn(llm, requests, hold_kv=turn < NUM_TURNS - 1))
        outputs = turns[-1][2]
    return [(tokens, seconds) for tokens, seconds, _ in turns]


def resend(llm: LLM, prompts: list[list[int]]) -> list[tuple[int, float]]:
    """Per turn: (prefill tokens, seconds) when every turn re-sends the whole conversation."""
    conversations = [list(p) for p in prompts]
    turns = []
    for turn in range(NUM_TURNS):
        if turn:
            for e, conversation in enumerate(conversations):
                conversation += environment_tokens(e, turn)
        tokens, seconds, outputs = timed_turn(llm, conversations, hold_kv=False)
        for conversation, output in zip(conversations, outputs):
            conversation += output.outputs[0].token_ids
        turns.append((tokens, seconds))
    return turns


def timed_turn(llm: LLM, requests: list, hold_kv: bool) -> tuple[int, float, list]:
    before = llm.stats()["prefill_tokens"]
    start = time.perf_counter()
    outputs = llm.generate(requests, PARAMS, use_tqdm=False, hold_kv=hold_kv)
    return llm.stats()["prefill_tokens"] - before, time.perf_counter() - start, outputs


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    setup_torch()
    folder = model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [chat_prompt_ids(tokenizer, f"Episode {e}: add the numbers the tool gives you.")
               for e in range(NUM_EPISODES)]
    ways = {"kept": (kept, True), "resend, prefix cache": (resend, True),
            "resend, no cache": (resend, False)}
    results = {name: run(LLM(str(folder), enable_prefix_caching=cache), prompts)
               for name, (run, cache) in ways.items()}
    print(f"{NUM_EPISODES} episodes x {NUM_TURNS} turns, {TURN_TOKENS} model + {ENV_TOKENS} "
          "environment tokens per turn, greedy, float32, 2 threads")
    rows = [("turn", *(f"{name} prefill" for name in ways), *(f"{name} s" for name in ways),
             "kept vs resend+cache s")]
    for turn in range(NUM_TURNS):
        cells = [results[name][turn] for name in ways]
        rows.append((str(turn + 1), *(str(tokens) for tokens, _ in cells),
                     *(f"{seconds:.2f}" for _, seconds in cells),
                     f"{cells[1][1] / cells[0][1]:.2f}x"))
    print_table(rows)


if __name__ == "__main__":
    main()
