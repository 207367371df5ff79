"""Multi-turn episode throughput with slow tools: a per-turn barrier, none, and the ideal bound.

Workload (the multi-turn issue's): 32 episodes of 4 model turns of 16 tokens on the embedded
SmolLM2-135M-Instruct, float32, 2 threads, greedy; after each turn the episode's tool answers
after a latency drawn uniformly from 0-200 ms (seeded, the same draws in every way), with a
short observation message. Episodes run through ``EpisodeRunner`` (KV kept between turns),
each way in a fresh engine:

- ``barrier``: every tool call also waits until all episodes' calls of that turn have
  returned (a ``threading.Barrier``), so each turn waits for the batch's slowest tool, as
  a loop that steps the whole batch per turn does;
- ``no barrier``: Tandem's runner as it is: an episode whose tool answered goes back into
  the running batch at the next engine step;
- ``compute alone``: the same episodes with tools answering at once (the engine's own time);
- ``ideal``: compute alone plus the longest per-episode tool time (the sum of one
  episode's own latencies): the time if no episode ever waited for another's tool.

Throughput is episodes per second. The target: no barrier within 10% of the ideal bound.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

from common import model_folder, print_table, setup_torch
from transformers import AutoTokenizer

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.environments import EnvStep
from tandem.trainers.episodes import EpisodeRunner

NUM_EPISODES, NUM_TURNS, TURN_TOKENS = 32, 4, 16
MAX_LATENCY = 0.2  # seconds; --max-latency changes it
PARAMS = SamplingParams(temperature=0, max_tokens=TURN_TOKENS, ignore_eos=True)


def latency(episode: int, turn: int) -> float:
    """The seconds episode ``episode``'s tool takes after model turn ``turn`` (seeded)."""
    return random.Random(1000 * episode + turn).uniform(0.0, 1.0) * MAX_LATENCY


class SlowTool:
    """Answers each turn with a short observation after the episode's own latency, then
    (with a barrier) waits for every other episode's answer of the same turn."""

    def __init__(self, episode: int, scale: float, barrier: threading.Barrier | None) -> None:
        self.episode, self.scale, self.barrier, self.turn = episode, scale, barrier, 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        time.sleep(self.scale * latency(self.episode, self.turn))
        if self.barrier is not None:
            self.barrier.wait()
        self.turn += 1
        return EnvStep([{"role": "user", "content": f"The tool returned {41 * self.turn}."}])


def run(folder: str, tokenizer, scale: float, barrier: bool) -> float:
    """Seconds to run every episode to its end, in a fresh engine."""
    llm = LLM(folder)
    runner = EpisodeRunner(llm.engine, tokenizer, PARAMS, max_turns=NUM_TURNS,
                           max_workers=NUM_EPISODES)
    wall = threading.Barrier(NUM_EPISODES) if barrier else None
    examples = [{"prompt": f"Episode {e}: add the numbers the tool gives you.", "episode": e}
                for e in range(NUM_EPISODES)]
    start = time.perf_counter()
    groups = runner.run(examples, lambda example: SlowTool(example["episode"], scale, wall))
    seconds = time.perf_counter() - start
    assert all(group[0].num_turns == NUM_TURNS for group in groups)
    assert llm.stats()["kv_blocks_used"] == 0
    return seconds


def main() -> None:
    global MAX_LATENCY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-latency", type=float, default=MAX_LATENCY,
                        help="the slowest tool answer, in seconds (the issue's: 0.2)")
    MAX_LATENCY = parser.parse_args().max_latency
    setup_torch()
    folder = str(model_folder())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    run(folder, tokenizer, 0.0, barrier=False)  # warm-up: first-call costs out of the figures
    seconds = {"barrier": run(folder, tokenizer, 1.0, barrier=True),
               "no barrier": run(folder, tokenizer, 1.0, barrier=False),
               "compute alone": run(folder, tokenizer, 0.0, barrier=False)}
    tool_time = max(sum(latency(e, t) for t in range(NUM_TURNS)) for e in range(NUM_EPISODES))
    slowest_per_turn = sum(max(latency(e, t) for e in range(NUM_EPISODES))
                           for t in range(NUM_TURNS))
    seconds["ideal"] = seconds["compute alone"] + tool_time
    print(f"{NUM_EPISODES} episodes x {NUM_TURNS} turns of {TURN_TOKENS} tokens, tools "
          f"0-{MAX_LATENCY * 1000:.0f} ms; longest episode tool time {tool_time:.2f} s, "
          f"sum of per-turn slowest {slowest_per_turn:.2f} s; greedy, float32, 2 threads")
    ideal = NUM_EPISODES / seconds["ideal"]
    rows = [("way", "seconds", "episodes/s", "vs ideal")]
    for name in ("barrier", "no barrier", "compute alone", "ideal"):
        rate = NUM_EPISODES / seconds[name]
        rows.append((name, f"{seconds[name]:.2f}", f"{rate:.2f}", f"{rate / ideal:.2f}"))
    print_table(rows)


if __name__ == "__main__":
    main()
