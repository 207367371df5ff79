"""What the engine reads from a model folder besides the weights: the tokenizer, the
end-of-sequence ids, and the longest sequence the model takes."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from .config import EngineConfig


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it has none (prompts must then be token ids)."""
    has_tokenizer = any((model_dir / name).exists() for name in
                        ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None


def eos_token_ids(model_dir: Path, hf_config: PretrainedConfig,
                  tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """Every end-of-sequence id the config, the generation config and the tokenizer name."""
    ids: set[int] = set()
    sources = [hf_config.eos_token_id]
    if (model_dir / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def resolve_max_model_len(config: EngineConfig, hf_config: PretrainedConfig) -> int:
    """``config.max_model_len``, or the model's limit (its positions); at most that limit.
    A sliding window limits what a layer attends to, not the length.

    Raises:
        ValueError: for a max_model_len beyond the model's limit.
    """
    limit = hf_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of "
                         f"{limit} tokens (max_position_embeddings): lower max_model_len.")
    return config.max_model_len
