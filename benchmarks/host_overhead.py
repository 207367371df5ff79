"""The host's time per decode step, by phase, with a model whose forward costs nothing.

The engine is Tandem's own, on CPU, over a tiny random Llama (1 layer, 16 wide, a 512-token
vocabulary). For the host's figure its forward is replaced by a null one that computes
nothing: the model's forward returns the positions, and the LM head a fixed random row
of logits per position, so sampling (and a seeded one) still means something. Everything
else runs as in production: the scheduler, the block manager, the runner's input
preparation, the sampler and the output processing. The reference, in the same run, is the
step time of the same engine over the real tiny model's forward.

Steady-state decode: every batch is ``batch`` requests of about ``context`` prompt tokens
(staggered over a block, so that a sixteenth of them starts a block each step), prefilled
before the clock starts; then ``--steps`` decode steps are timed (``ignore_eos``, room
left in ``max_tokens``), the median of ``--repeats`` runs. Phases, timed by wrapping the
engine's own functions: schedule (``Scheduler.schedule``), block tables (the batch's block
tables and slot mapping, ``InputBatch.block_tables`` and ``slot_mapping``; in a version
before ``InputBatch``, the padded block-table tensor only), input tensors (the rest of
``ModelRunner._prepare``), forward
(the forward pass and LM head: nothing with the null model), sampler (``Sampler.sample``:
the sampling maths and its per-sequence bookkeeping), outputs (``Scheduler.advance`` and
``Scheduler.append_sampled``; before overlapped steps ``update_from_output``), and the rest
of ``LLMEngine.step`` (the samples' copy to lists among it).

Target (issue 46): at most 1.5 ms a step at batch 256 and 100-token contexts on a 2-core
CPU, and no more than 1.5x that at 1k-token contexts.

Run::

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --batch-sizes 256 --contexts 100 --seeded
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from common import print_table, setup_torch, timed
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker import model_runner as model_runner_module

TARGET_MS = 1.5
VOCAB_SIZE = 512
MAX_CONTEXT = 1024
PHASES = ("schedule", "block tables", "input tensors", "forward", "sampler", "outputs")


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median kept)")
    parser.add_argument("--seeded", action="store_true",
                        help="give every request its own seed (per-request generators)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the real model's step time")
    return parser.parse_args()


def save_tiny_model(folder: Path) -> Path:
    """Save a random 1-layer, 16-wide Llama with a 512-token vocabulary (no tokenizer:
    prompts are token ids) to ``folder``."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * MAX_CONTEXT,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False))
    model.save_pretrained(folder)
    return folder


def build_engine(folder: Path, max_batch: int, max_steps: int) -> LLM:
    """An engine over ``folder`` with room for ``max_batch`` sequences of the longest
    context and ``max_steps`` decode steps more."""
    tokens_per_seq = MAX_CONTEXT + 2 * 16 + max_steps + 16
    return LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=max_batch,
               num_kv_blocks=max_batch * (tokens_per_seq // 16 + 2) + 16)


def null_forward(llm: LLM) -> None:
    """Make ``llm``'s model compute nothing: its forward returns each token's position (as a
    ``[tokens, 1]`` hidden state), its LM head a fixed random logit row per position."""
    model = llm.engine.runner.model
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(2 * MAX_CONTEXT, VOCAB_SIZE, generator=generator)
    model.forward = lambda input_ids, positions, metadata: positions[:, None]
    model.compute_logits = lambda hidden: table[hidden[:, 0]]


@contextmanager
def timed_phases(llm: LLM, seconds: dict[str, float]) -> Iterator[None]:
    """Add each phase's seconds to ``seconds`` while inside (wrapping the engine's
    functions on their instances, and the module functions the block tables come from)."""
    engine, runner = llm.engine, llm.engine.runner
    wrapped = [(engine.scheduler, "schedule", "schedule"),
               (runner, "_prepare", "input tensors"), (runner, "_forward", "forward"),
               (runner.model, "compute_logits", "forward"),
               *((engine.scheduler, name, "outputs") for name in output_functions(engine))]
    wrapped += [(owner, name, "block tables") for owner, name in block_table_functions(runner)]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in wrapped]
    for owner, name, phase in wrapped:
        setattr(owner, name, timed_function(getattr(owner, name), phase, seconds))
    sampler = runner.sampler
    runner.sampler = TimedSampler(sampler, seconds)
    try:
        yield
    finally:
        runner.sampler = sampler
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def output_functions(engine: object) -> list[str]:
    """The scheduler's functions that take a step's samples, in the version at hand."""
    if hasattr(engine.scheduler, "append_sampled"):
        return ["advance", "append_sampled"]
    return ["update_from_output"]


def block_table_functions(runner: object) -> list[tuple[object, str]]:
    """The functions that build a step's block tables and slot mapping, in the version of
    the runner at hand: the persistent batch's, else the module's ``padded_tensor``."""
    batch = getattr(runner, "input_batch", None)
    if batch is not None:
        return [(batch, "block_tables"), (batch, "slot_mapping")]
    return [(model_runner_module, "padded_tensor")]


def timed_function(function: Callable, phase: str, seconds: dict[str, float]) -> Callable:
    """``function``, adding its wall seconds to ``seconds[phase]``; time spent inside
    another timed function is that one's (block tables inside input tensors)."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        nested = sum(seconds.values())
        try:
            return function(*args, **kwargs)
        finally:
            inner = sum(seconds.values()) - nested
            seconds[phase] += time.perf_counter() - start - inner
    return run


class TimedSampler:
    """A sampler whose calls add their seconds to ``seconds["sampler"]``."""

    def __init__(self, sampler: object, seconds: dict[str, float]) -> None:
        self.sampler = sampler
        self.call = timed_function(sampler.__call__, "sampler", seconds)
        if hasattr(sampler, "sample"):
            self.sample = timed_function(sampler.sample, "sampler", seconds)

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def prefill(llm: LLM, batch: int, context: int, steps: int, seeded: bool) -> None:
    """Queue ``batch`` random prompts of ``context`` to ``context + 15`` tokens and step
    until every one has sampled its first token (no request is waiting or prefilling).

    Unseeded requests share one ``SamplingParams`` (as ``LLM.generate`` given one); seeded
    ones have one each (their own seed)."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(context * 1000 + batch)
    shared = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=1.0)
    for i in range(batch):
        prompt = torch.randint(2, VOCAB_SIZE, (context + i % 16,), generator=generator)
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=1.0,
                                seed=i) if seeded else shared
        engine.add_request(f"r{i}", prompt.tolist(), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
        engine.step()


@dataclass(slots=True)
class Timing:
    """One run: milliseconds per step, each phase's milliseconds per step, and the share
    of the machine's CPU time that other processes took meanwhile (``common.timed``)."""

    ms: float
    phases: dict[str, float]
    others_cpu: float


def time_decode(llm: LLM, batch: int, context: int, args: argparse.Namespace,
                phases: bool) -> Timing:
    """Time ``args.steps`` decode steps at ``batch`` x ``context`` (with ``phases``, each
    phase too); every request is aborted after."""
    engine = llm.engine
    prefill(llm, batch, context, args.steps, args.seeded)
    seconds: dict[str, float] = defaultdict(float)
    with timed_phases(llm, seconds) if phases else nullcontext():
        _, total, others = timed(lambda: [engine.step() for _ in range(args.steps)])
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return Timing(total * 1e3 / args.steps,
                  {name: value * 1e3 / args.steps for name, value in seconds.items()}, others)


def measure(llm: LLM, batch: int, context: int, args: argparse.Namespace,
            phases: bool) -> Timing:
    """The median of ``args.repeats`` runs."""
    runs = [time_decode(llm, batch, context, args, phases) for _ in range(args.repeats)]
    return sorted(runs, key=lambda run: run.ms)[len(runs) // 2]


def row(batch: int, context: int, null: Timing, reference: Timing | None) -> tuple[str, ...]:
    """One table row: the shape, the reference and null step times, the microseconds per
    sequence, the phases in milliseconds (and the rest of the step), and the largest share
    of CPU time other processes took during either run."""
    rest = null.ms - sum(null.phases.values())
    busy = max(null.others_cpu, 0.0 if reference is None else reference.others_cpu)
    return (str(batch), str(context), "-" if reference is None else f"{reference.ms:.2f}",
            f"{null.ms:.2f}", f"{null.ms * 1e3 / batch:.1f}",
            *(f"{null.phases.get(name, 0.0):.3f}" for name in PHASES), f"{rest:.3f}",
            f"{busy:.0%}")


def main() -> None:
    """Measure every (context, batch) shape and print the table with the target line."""
    args = parse_args()
    setup_torch()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_model(Path(tmp))
        largest = max(args.batch_sizes)
        null = build_engine(folder, largest, args.steps)
        null_forward(null)
        real = None if args.no_reference else build_engine(folder, largest, args.steps)
        rows = [("batch", "context", "real ms", "null ms", "us/seq", *PHASES, "rest",
                 "others")]
        for context in args.contexts:
            for batch in args.batch_sizes:
                measure(null, batch, context, args, phases=False)  # warm-up
                timing = measure(null, batch, context, args, phases=True)
                reference = None if real is None else measure(real, batch, context, args,
                                                              phases=False)
                rows.append(row(batch, context, timing, reference))
    print(f"host time per decode step (ms; {args.steps} steps, median of {args.repeats}, "
          f"{'seeded' if args.seeded else 'unseeded'}, 2 threads); real: the tiny model's "
          "forward; null: no forward")
    print_table(rows)
    print(f"target: <= {TARGET_MS} ms (null) at batch 256, context 100; "
          f"<= {1.5 * TARGET_MS} ms at context 1000. others: the share of the machine's CPU "
          "time other processes took (timings hold only near 0%)")


if __name__ == "__main__":
    main()
