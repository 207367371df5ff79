"""The trainer's forward and backward with each shared prefix computed once (issue 59),
against the unshared forward as the reference, in the same run.

Cases, on the embedded SmolLM2-135M-Instruct (float32, 2 threads):

- ``main job``: README's main job (recipes/grpo_arith.yaml): 8 arithmetic prompts (chat
  template, system line, question: about 33 tokens) x 8 completions sampled by the engine
  (temperature 0.8, at most 16 tokens: about 8-16), micro_batch_size 32;
- ``long prompt``: 2 prompts of about 512 tokens (a paragraph repeated in the user
  message) x 8 completions of 16 tokens, micro_batch_size 16.

Each (case, mode) runs in a fresh process (the peak memory is its own): it samples the
rollout (the same in both modes: the engine's seed), then times the trainer's step work
over it, micro-batch by micro-batch as ``Trainer._optimize`` does it (the shared mode's
micro-batches whole groups packed by cost, ``micro_batches.group_slices``; the unshared
mode's rows every ``micro_batch_size``): the exact forward (``LLM.exact_forward`` with
``shared_prefix`` on or off), the completion log-probs and a loss over them, and the
backward. The figure is the median over ``--rounds`` rounds after one untimed warm-up, the
stream's tokens per step, and the peak resident memory above the process's resident memory
before the first round (``ru_maxrss``, so: the step's activations, gradients and logits).
Both modes' log-probs are checked equal bit for bit.

Run::

    python benchmarks/shared_prefix.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from common import model_folder, print_table, setup_torch

PARAGRAPH = ("Tandem shares a machine between a trainer and its rollout engine: the engine "
             "samples groups of completions of each prompt, the trainer scores them and "
             "takes a step, and the new weights go back into the engine. ")
CASES = {"main job": dict(prompts=8, n=8, max_tokens=16, min_tokens=0, words=0, micro=32),
         "long prompt": dict(prompts=2, n=8, max_tokens=16, min_tokens=16, words=330,
                             micro=16)}


def rollout(case: dict, tokenizer, llm) -> tuple[list, list, list]:
    """The case's prompts (token ids), completions and group ids, sampled by ``llm``."""
    from tandem.rollout import SamplingParams
    from tandem.trainers.tasks import build_task

    task = build_task("arith", max_operand=9, operations="+-")
    words = PARAGRAPH.split()
    prompts = []
    for index in range(case["prompts"]):
        messages = task.train_example(0, index)["prompt"]
        if case["words"]:
            text = " ".join(words[(index + i) % len(words)] for i in range(case["words"]))
            messages = [{**m, "content": text + " " + m["content"]} if m["role"] == "user"
                        else m for m in messages]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    params = SamplingParams(n=case["n"], temperature=0.8, max_tokens=case["max_tokens"],
                            min_tokens=case["min_tokens"], seed=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    rows = [(p, c.token_ids, g) for g, (p, o) in enumerate(zip(prompts, outputs))
            for c in o.outputs]
    return [list(column) for column in zip(*rows)]


def measure(name: str, shared: bool, rounds: int) -> dict:
    """One (case, mode) in this process: seconds per step (median), stream tokens, peak
    memory above the start, and the log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.rollout import LLM
    from tandem.trainers.micro_batches import group_slices, row_slices
    from tandem.trainers.policy import completion_logprobs, token_batch

    setup_torch()
    case, folder = CASES[name], model_folder()
    llm = LLM(str(folder), max_model_len=1024)
    prompts, completions, groups = rollout(case, AutoTokenizer.from_pretrained(folder), llm)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    forward = llm.exact_forward(model, shared_prefix=shared)
    batch, group_ids = token_batch(prompts, completions, 0), torch.tensor(groups)
    slices = group_slices(batch, group_ids, case["micro"]) if shared else \
        row_slices(len(prompts), case["micro"])
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(rounds + 1):
        model.zero_grad(set_to_none=True)
        begin, logprobs = time.perf_counter(), []
        for rows in slices:
            micro = batch.rows(rows)
            scored, _, _ = completion_logprobs(forward, micro, 0.8)
            (scored * micro.completion_mask).sum().backward()
            logprobs.append(scored.detach())
        seconds.append(time.perf_counter() - begin)
    stream = sum(_stream_tokens(forward, batch.rows(rows)) for rows in slices)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss
    return {"seconds": statistics.median(seconds[1:]), "stream": stream,
            "peak_mib": peak / 1024, "micro": len(slices), "rows": len(prompts),
            "logprobs": torch.cat(logprobs)}


def _stream_tokens(forward, batch) -> int:
    """The tokens ``forward``'s stream computes for ``batch``."""
    from tandem.rollout.worker.shared_prefix import token_stream

    keys = torch.stack([batch.input_ids, batch.position_ids], -1)
    return token_stream(keys, batch.attention_mask, forward.shared_prefix).num_tokens


def fresh(name: str, shared: bool, rounds: int) -> dict:
    """``measure`` in a fresh process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, name, shared, rounds).result()


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    setup_torch()
    print(f"SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads, median of "
          f"{args.rounds} rounds")
    rows = [("case", "mode", "rows", "micro-batches", "stream tokens", "fwd+bwd s/step",
             "speed-up", "peak MiB above start", "log-probs")]
    for name in CASES:
        unshared = fresh(name, False, args.rounds)
        shared = fresh(name, True, args.rounds)
        same = torch.equal(shared["logprobs"], unshared["logprobs"])
        for mode, run in (("unshared", unshared), ("shared", shared)):
            rows.append((name, mode, str(run["rows"]), str(run["micro"]), str(run["stream"]),
                         f"{run['seconds']:.2f}",
                         f"{unshared['seconds'] / run['seconds']:.2f}x",
                         f"{run['peak_mib']:.0f}",
                         "reference" if mode == "unshared" else
                         ("bit for bit" if same else "DIFFER")))
        print_table(rows)


if __name__ == "__main__":
    main()
