"""What every section of the GPU check shares: the recorder, timing, the model shapes and the
random-weight model folders (see ``gpu_check.py``)."""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from common import CHAT_TEMPLATE, byte_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tandem.rollout import LLM

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                 eos_token_id=151645)
QWEN3_8B = QWEN3_06B | dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8,
                            tie_word_embeddings=False)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
           tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
TOKENIZER_TEXT = ["What is 2+3? The answer is 5.", "If I have 7 apples and eat 2, 5 are left.",
                  "Seventeen times four is sixty-eight.", '{"name": "Ada", "age": 36}']


class Recorder:
    """Appends each result to ``results.jsonl`` at once, so a killed run keeps what it had;
    a failed section's traceback goes to ``tracebacks.txt``."""

    def __init__(self, out: Path, budget: float, smoke: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.path = out / "results.jsonl"
        self.deadline = time.monotonic() + budget
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")

    def seconds_left(self) -> float:
        """Seconds until the budget runs out."""
        return self.deadline - time.monotonic()

    def record(self, section: str, name: str, **values) -> None:
        """Append one result row and echo it."""
        row = {"section": section, "name": name, **values}
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def record_traceback(self, section: str) -> None:
        """Append the exception being handled, with its section, to ``tracebacks.txt``."""
        with (self.out / "tracebacks.txt").open("a") as file:
            file.write(f"--- {section}\n{traceback.format_exc()}\n")


def sync() -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``call`` over ``repeats`` synchronised runs, after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def timed(call: Callable[[], object]) -> float:
    """Wall seconds of one synchronised ``call``."""
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def device_used_bytes() -> int:
    """Bytes in use on the whole device (every process's), 0 on CPU."""
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def device_total_bytes() -> int:
    """The device's memory, 0 on CPU."""
    return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0


def collect() -> None:
    """Collect garbage (engines hold reference cycles) and return the allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def live_engines() -> int:
    """How many ``LLMEngine`` objects this process still holds."""
    from tandem.rollout import LLMEngine

    return sum(type(obj) is LLMEngine for obj in gc.get_objects())  # no __class__ lookups


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the dtype as the results name it."""
    return str(dtype).removeprefix("torch.")


def save_word_tokenizer(folder: Path, shape: dict) -> None:
    """A tokenizer in which every id of the model is a word (``w17``), so any sampled token
    detokenizes to text (a random model samples all over its vocabulary), with a chat
    template; text outside it reads as ``<|unk|>``."""
    size = shape["vocab_size"]
    specials = {shape["bos_token_id"]: "<|bos|>", shape["eos_token_id"]: "<|eos|>",
                size - 1: "<|im_start|>", size - 2: "<|unk|>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                            eos_token="<|eos|>", pad_token="<|eos|>", unk_token="<|unk|>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(folder)


def save_byte_tokenizer(folder: Path) -> int:
    """A small byte-level BPE tokenizer (any text, JSON included); returns its size."""
    tokenizer = byte_tokenizer(TOKENIZER_TEXT)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def save_random_model(shape: dict, folder: Path, dtype: torch.dtype, device: torch.device,
                      seed: int = 0, word_tokenizer: bool = True) -> Path:
    """Save a random-weight Qwen3 of ``shape`` (built on ``device``; a Qwen3-MoE where the
    shape has experts, ``num_experts``) and, with ``word_tokenizer``, a word tokenizer of its
    vocabulary to ``folder``; returns it."""
    config = (Qwen3MoeConfig if "num_experts" in shape else Qwen3Config)(**shape)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    if word_tokenizer:
        save_word_tokenizer(folder, shape)
    del model
    collect()
    return folder


def vocab_size(folder: Path) -> int:
    """The vocabulary size in a saved model's config."""
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def load_hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The saved model through transformers, in ``dtype`` on ``device``."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def make_llm(rec: Recorder, folder: Path, **options) -> LLM:
    """An engine on ``folder`` sized for the check: a 0.3 share of the GPU, or 512 KV blocks
    on CPU, up to 64 sequences a step (fewer graphs to capture), without the batch-invariant
    kernels (off on CUDA, which the check measures; the CPU smoke run takes the same path,
    alias updates included); ``options`` override."""
    sizing = {"num_kv_blocks": 512} if rec.smoke else {"gpu_memory_utilization": 0.3}
    if options.keys() & {"num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization"}:
        sizing = {}
    defaults = dict(device=str(rec.device), max_model_len=512 if rec.smoke else 4096,
                    max_num_seqs=16 if rec.smoke else 64, exact_logprobs=False)
    return LLM(str(folder), **(defaults | sizing | options))
