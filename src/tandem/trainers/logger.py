"""Metrics sinks: the console, a JSON-lines file and Weights & Biases (rank 0 only).

W&B runs offline unless the recipe or ``WANDB_MODE`` says online; when wandb is not installed
the run goes on without it and says so once. A resumed run continues both: the JSON-lines
file from the checkpoint's step, the W&B run by its id (saved with each checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .config import LoggingConfig


class MetricsLogger:
    """Writes each step's metrics to the enabled sinks.

    Args:
        start_step: the step the run starts after (the checkpoint's on resume, else 0): the
            JSON-lines file keeps only its lines up to it, and the new steps follow them.
        wandb_run_id: the W&B run to continue (``resume="allow"``: a new run with this id
            when W&B does not know it); None starts a new run.

    Attributes:
        jsonl_path: the JSON-lines file (None when disabled).
        wandb_dir: where W&B wrote the run (None when W&B is off or missing).
    """

    def __init__(self, config: LoggingConfig, output_dir: Path, run_config: dict[str, Any],
                 enabled: bool = True, start_step: int = 0,
                 wandb_run_id: str | None = None) -> None:
        self.config = config
        self.enabled = enabled
        self.jsonl_path = output_dir / "metrics.jsonl" if enabled and config.jsonl else None
        if self.jsonl_path is not None:
            keep_steps_up_to(self.jsonl_path, start_step)
        self.wandb_run = None
        self.wandb_dir: str | None = None
        if enabled and config.wandb:
            self._start_wandb(output_dir, run_config, wandb_run_id)

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (None when W&B is off or missing)."""
        return None if self.wandb_run is None else self.wandb_run.id

    def _start_wandb(self, output_dir: Path, run_config: dict[str, Any],
                     run_id: str | None) -> None:
        try:
            import wandb
        except ImportError:
            print("tandem: wandb is not installed (pip install 'tandem-rollout[train]'); "
                  "logging to the console and JSONL only.", file=sys.stderr)
            return
        mode = os.environ.get("WANDB_MODE", self.config.wandb_mode)
        resume = {} if run_id is None else {"id": run_id, "resume": "allow"}
        self.wandb_run = wandb.init(project=self.config.wandb_project, mode=mode,
                                    dir=str(output_dir), config=run_config, **resume)
        self.wandb_dir = str(Path(self.wandb_run.dir).parent)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics."""
        if not self.enabled:
            return
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as file:
                file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        every = self.config.console_every
        if every and step % every == 0:
            shown = ("loss", "reward", "reward_std", "completion_length", "clip_fraction",
                     "sampler_logprob_diff_max", "rollout_tok_per_s", "rollout_seconds",
                     "train_seconds", "sync_seconds")
            parts = [f"{key}={metrics[key]:.4g}" for key in shown if key in metrics]
            tqdm.write(f"step {step}: " + " ".join(parts))

    def finish(self) -> None:
        """Close the W&B run."""
        if self.wandb_run is not None:
            self.wandb_run.finish()


def keep_steps_up_to(path: Path, last_step: int) -> None:
    """Rewrite the JSON-lines file ``path`` (if any) with only its lines of steps up to
    ``last_step``: the steps after it were lost with the run that logged them (a resume
    repeats them), and a line torn by a kill goes too. The new file replaces the old in one
    rename, so a kill here leaves one or the other."""
    if not path.exists():
        return
    kept = [line + "\n" for line in path.read_text().splitlines() if _logged_by(line, last_step)]
    staged = path.with_name(f".{path.name}.partial")
    staged.write_text("".join(kept))
    os.replace(staged, path)


def _logged_by(line: str, last_step: int) -> bool:
    """Whether ``line`` is a whole metrics line of a step up to ``last_step``."""
    try:
        return int(json.loads(line)["step"]) <= last_step
    except (ValueError, KeyError, TypeError):
        return False
