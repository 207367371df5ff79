"""Pieces shared by the CPU benchmarks (``grpo_cpu.py``, ``cpu_latency.py``, ``matmul_floor.py``).

The scripts run as ``python benchmarks/<script>.py`` from the repository root, so this
folder is on ``sys.path`` and they import this module as ``common``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tandem.rollout import LLM
from tandem.rollout.default_model import embedded_model_dir

NUM_THREADS = 2
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj"))
DTYPES = ("float32", "bfloat16")
T = TypeVar("T")


@dataclass
class Run:
    """One timed generation call.

    ``lengths``: the tokens each sequence generated; ``seconds``: the call's wall time;
    ``others_cpu``: the share (0 to 1) of the machine's CPU time that other processes used
    meanwhile (see ``timed``).
    """

    lengths: list[int]
    seconds: float
    others_cpu: float

    @property
    def tokens(self) -> int:
        """Generated tokens over all sequences."""
        return sum(self.lengths)

    @property
    def tok_s(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.seconds


# As the ``tandem`` command runs (cli/__init__.py): torch's large CPU tensors on huge pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def setup_torch() -> None:
    """Fix the thread count and the global seed the way every benchmark runs."""
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(0)


def model_folder() -> Path:
    """The local folder of the embedded SmolLM2-135M-Instruct."""
    return Path(embedded_model_dir())


def load_hf_model(folder: Path, dtype: str) -> torch.nn.Module:
    """Load the Hugging Face model in ``dtype`` for inference."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.eval()


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, message: str) -> list[int]:
    """Token ids of one user ``message`` with the chat template applied (generation prompt on)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokens_until_eos(tokens: Sequence[int], eos_token_id: int) -> int:
    """Count ``tokens`` up to and including the first EOS (all of them when there is none)."""
    tokens = list(tokens)
    return tokens.index(eos_token_id) + 1 if eos_token_id in tokens else len(tokens)


def machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot, over every core (Linux ``/proc/stat``)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(call: Callable[[], T]) -> tuple[T, float, float]:
    """Run ``call``; return its result, its wall seconds and the other processes' CPU share.

    That share is the machine's busy time less this process's own CPU time, over the wall
    time of every core; timings are only comparable when it is near zero.
    """
    busy, own, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    others = machine_busy_seconds() - busy - (time.process_time() - own)
    return result, seconds, max(0.0, others) / (seconds * (os.cpu_count() or 1))


def measure(call: Callable[[], list[int]], repeats: int) -> Run:
    """Run ``call`` once untimed, then ``repeats`` times timed; return the median run by tok/s.

    ``call`` returns the number of tokens each sequence generated.
    """
    call()
    runs = [Run(*timed(call)) for _ in range(repeats)]
    runs.sort(key=lambda run: run.tok_s)
    return runs[(len(runs) - 1) // 2]


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` (the first one is the header) as right-aligned columns."""
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


def timed_steps(trainer, steps: int) -> list[dict[str, float]]:
    """Run ``steps`` training steps of a ``Trainer``; each step's metrics, with its wall
    seconds as ``step_seconds``."""
    history = []
    for _ in range(steps):
        start = time.perf_counter()
        metrics = trainer.train_step()
        metrics["step_seconds"] = time.perf_counter() - start
        history.append(metrics)
    return history


def report_linear_layout(llm: LLM) -> None:
    """Print the CPU linear layout the engine timed fastest when it loaded (see
    ``kernels/cpu_linear.py``): figures from different machines may differ by it."""
    print(f"  tandem's linear layout: {llm.engine.runner.model.linear_layout or 'F.linear'}",
          flush=True)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_tokenizer(sentences: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text) of about 320 tokens trained on ``sentences``,
    with ``<|bos|>``, ``<|eos|>`` and a chat template, for random test models."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sentences * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|eos|>",
                                   chat_template=CHAT_TEMPLATE)
