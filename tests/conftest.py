"""Tiny random models saved as Hugging Face folders (nothing comes from a hub).

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on
before Triton is first imported: here, before any test module imports anything. The Hub's
offline switches are read at import too, so they are set here as well: ``load_dataset``
reads local files and the local cache only.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

torch.set_num_threads(2)

CORPUS = [
    "What is 2+3? The answer is 5.", "The quick brown fox jumps over the lazy dog.",
    "Tandem shares a GPU with the trainer and samples groups of completions.",
    "def add(a, b):\n    return a + b\n", "Seventeen times four is sixty-eight.",
] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=0, eos_token_id=1, pad_token_id=1)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a tiny corpus, with EOS and chat markers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|eos|>",
                                   chat_template=CHAT_TEMPLATE)


CONFIGS = {
    "llama": lambda v: LlamaConfig(vocab_size=v, tie_word_embeddings=False, **SMALL),
    "qwen2": lambda v: Qwen2Config(vocab_size=v, tie_word_embeddings=False, **SMALL),
    "qwen3": lambda v: Qwen3Config(vocab_size=v, head_dim=32, tie_word_embeddings=True, **SMALL),
    "mistral": lambda v: MistralConfig(vocab_size=v, sliding_window=None, **SMALL),
    "llama3-rope": lambda v: LlamaConfig(
        vocab_size=v, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **SMALL),
    "yarn-rope": lambda v: Qwen2Config(
        vocab_size=v, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 4.0, "original_max_position_embeddings": 128},
        **SMALL),
    "linear-rope": lambda v: LlamaConfig(
        vocab_size=v, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                       "factor": 2.0}, **SMALL),
}


def save_model(kind: str, path: Path, seed: int = 0) -> Path:
    """Save a tiny random model of ``kind`` with the shared tokenizer into ``path``."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = CONFIGS[kind](len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A factory: ``model_dir("qwen3")`` is the folder of that tiny model (built once)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = save_model(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dir) -> Path:
    """The tiny Llama folder."""
    return model_dir("llama")


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``datasets`` cache folder for the test (not ``~/.cache``); ``datasets`` reads
    its cache path at import, so the setting it read is replaced."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 fitted to call a tool (see ``tests/tool_model.py``), built once."""
    from .tool_model import save_tool_model

    return save_tool_model(tmp_path_factory.mktemp("tool_model"))


TOKENIZING = ("encode", "__call__", "apply_chat_template", "encode_plus", "batch_encode_plus")


class CountingTokenizer:
    """A tokenizer that counts each call of it that tokenizes, by method."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        attribute = getattr(self.tokenizer, name)
        if name not in TOKENIZING:
            return attribute

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attribute(*args, **kwargs)

        return counted

    def __call__(self, *args, **kwargs):
        self.calls["__call__"] += 1
        return self.tokenizer(*args, **kwargs)


def count_tokenizations(engine, monkeypatch: pytest.MonkeyPatch) -> CountingTokenizer:
    """Swap ``engine``'s tokenizer (where prompts are tokenized) for a counting one."""
    assert engine.tokenizer is engine.input_processor.tokenizer
    tokenizer = CountingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)
    monkeypatch.setattr(engine.input_processor, "tokenizer", tokenizer)
    return tokenizer
