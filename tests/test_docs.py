"""The documentation: the site builds with no broken link or reference (``mkdocs build
--strict``, offline), and the Python examples of README.md and every page under docs/ run
as written (a block after ``<!-- not run: why -->`` is a fragment, and is not)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .test_server import serve_command

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```python\n(.*?)```", re.S)
SERVED = "http://127.0.0.1:8000"  # what the examples call a running `tandem serve`
LM_EVAL_SECTION = "## Evaluate a checkpoint with lm-eval"
CHECKPOINT = "runs/grpo_arith/checkpoint-20"  # what the lm-eval example serves


def examples() -> list:
    found = []
    for page in PAGES:
        blocks = [m[2] for m in BLOCK.finditer(page.read_text()) if not m[1]]
        found += [pytest.param(code, id=f"{page.relative_to(ROOT)}-{i}")
                  for i, code in enumerate(blocks)]
    return found


def test_the_site_builds_strictly_with_every_page_in_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    training = (tmp_path / "site" / "guides" / "training" / "index.html").read_text()
    assert "rollout.engine.max_num_seqs" in training  # the generated recipe keys


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in PAGES[1:]}
    assert {page for page in pages if page not in nav} == set()


@pytest.mark.slow
@pytest.mark.parametrize("code", examples())
def test_the_example_runs(code):
    if SERVED not in code:
        exec(compile(code, "<example>", "exec"), {})
        return
    with serve_command("smollm2-135m-instruct", "--api-key", "KEY",
                       "--max-model-len", "512") as (process, url):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        exec(compile(code.replace(SERVED, url), "<example>", "exec"), {})


def test_the_lm_eval_example_runs(llama_dir):
    # serving.md's lm-eval section: its `tandem serve` line (on a free port) with the tiny
    # Llama as the checkpoint, then its lm-eval commands as written, against that server.
    section = (ROOT / "docs" / "guides" / "serving.md").read_text().split(LM_EVAL_SECTION)[1]
    serve, evaluate = re.findall(r"```bash\n(.*?)```", section, re.S)
    command = shlex.split(serve.replace(CHECKPOINT, str(llama_dir)))
    assert command[:3] == ["tandem", "serve", str(llama_dir)]
    port = command.index("--port")
    assert command[port + 1] == SERVED.rsplit(":", 1)[1]
    with serve_command(llama_dir, *command[3:port], *command[port + 2:]) as (process, url):
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c",
             evaluate.replace(CHECKPOINT, str(llama_dir)).replace(SERVED, url)],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
            env=os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr[-3000:]
    for task in ("tandem_arith_choice", "tandem_arith_gen"):
        assert task in result.stdout
