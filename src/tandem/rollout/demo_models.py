"""Small random models built on first use, for recipes that show mechanics on a CPU in a
few minutes: ``tiny-random-moe``, a Qwen3-MoE of 8 experts (top 2) over a 320-token
byte-level vocabulary.

Built deterministically (seed 0) and saved to the cache folder like the embedded default,
so every machine gets the same weights, tokenizer and so the same target token.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from tandem.kernels.cpu_build import cache_dir

TINY_MOE = "tiny-random-moe"
CORPUS = ["the cat sat on a mat and the dog ran far", "a dog and a cat ran on the mat",
          "far on the mat the cat sat and ran", "one two three four five six seven"] * 8
# initializer_range 0.2: peaked, varied next-token distributions (a random model at
# transformers' default 0.02 samples near-uniformly, so a target token is never rewarded)
CONFIG = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=1, pad_token_id=1)


def demo_model_dir(name: str) -> Path | None:
    """The folder of the demo model ``name``, built on first use; None for another name."""
    if name.lower() != TINY_MOE:
        return None
    target = cache_dir() / TINY_MOE
    if not (target / "config.json").is_file():
        _build_tiny_moe(target)
    return target


def _build_tiny_moe(target: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|eos|>")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(vocab_size=len(fast), **CONFIG),
                                             dtype=torch.float32)
    torch.random.set_rng_state(generator_state)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:  # complete, or absent
        model.save_pretrained(work)
        fast.save_pretrained(work)
        Path(work).rename(target)
