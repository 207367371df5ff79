"""The GPU check's ``families`` section (issue 58): each new model family's greedy tokens,
Triton with decode graphs, against eager transformers on the same GPU, in float32.

Small random models of each family (Phi-3 with LongRoPE and a partial rotary, Gemma 3 and
Gemma 2 with sliding and full layers, GPT-OSS with sinks, alternating windows and experts),
their windows short enough that the prompts pass them (so the sliding layers' KV groups
drop pages); 8 prompts of 96 tokens, 32 greedy tokens each, transformers generating the 8
as one batch (equal lengths, no padding) with ``attn_implementation="eager"``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gpu_check_common import Recorder, collect, make_llm, save_word_tokenizer
from gpu_check_engine import greedy, random_prompts
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Phi3Config,
    PretrainedConfig,
)

COMMON = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
              pad_token_id=1, initializer_range=0.1)
TOY = dict(COMMON, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
SLIDING = ["sliding_attention", "full_attention"] * 2


def family_configs(smoke: bool) -> dict[str, PretrainedConfig]:
    """Each family's random config (toy-sized with ``--smoke``)."""
    shape = TOY if smoke else COMMON
    rotary = shape["head_dim"] * 3 // 4
    # the original length above the engine's max_model_len: both sides take the short
    # factors (transformers picks per sequence, the engine per max_model_len)
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0,
                "original_max_position_embeddings": 512, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(rotary // 2)],
                "long_factor": [1.5 + 0.1 * i for i in range(rotary // 2)]}
    return {
        "phi-3": Phi3Config(**shape, partial_rotary_factor=0.75, rope_parameters=longrope,
                            original_max_position_embeddings=512, tie_word_embeddings=False),
        "gemma-3": Gemma3TextConfig(**shape, sliding_window=16, layer_types=SLIDING,
                                    query_pre_attn_scalar=shape["head_dim"]),
        "gemma-2": Gemma2Config(**shape, sliding_window=16, layer_types=SLIDING,
                                query_pre_attn_scalar=shape["head_dim"]),
        "gpt-oss": GptOssConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=16, layer_types=SLIDING),
    }


def save_family(config: PretrainedConfig, folder: Path, device: torch.device) -> Path:
    """The random model (seed 0; GPT-OSS's sinks random too), with a word tokenizer."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, parameter in model.named_parameters():
            if name.endswith("sinks") or "norm" in name:  # zeros at init: make them count
                parameter.data.normal_(0, 0.5)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, config.to_dict())
    del model
    collect()
    return folder


def transformers_greedy(folder: Path, prompts: list[list[int]], max_tokens: int,
                        device: torch.device) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager").to(device).eval()
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    del model
    collect()
    return out[:, ids.shape[1]:].tolist()


def check_families(rec: Recorder, work: Path) -> None:
    """Each family's greedy tokens against eager transformers (the module docstring)."""
    length = 24 if rec.smoke else 96
    prompts = random_prompts(4 if rec.smoke else 8, length, length + 1, seed=5)
    max_tokens = 4 if rec.smoke else 32
    for name, config in family_configs(rec.smoke).items():
        folder = save_family(config, work / f"family-{name}", rec.device)
        want = transformers_greedy(folder, prompts, max_tokens, rec.device)
        llm = make_llm(rec, folder, dtype="float32", max_model_len=256)
        got = greedy(llm, prompts, max_tokens)
        groups = llm.engine.kv_groups.windows
        del llm
        collect()
        equal = sum(a == b for a, b in zip(got, want))
        rec.record("families", f"{name}: greedy = eager transformers", dtype="float32",
                   kv_groups=len(groups), equal_sequences=f"{equal}/{len(want)}",
                   ok=equal == len(want))
