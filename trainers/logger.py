"""Metrics sinks: the console, a JSON-lines file and Weights & Biases (rank 0 only).

W&B runs offline unless the recipe or ``WANDB_MODE`` says online; when wandb is not installed
the run goes on without it and says so once.
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

    Attributes:
        jsonl_path: the JSON-lines file (None when disabled).
        wandb_dir: where W&B wrote the run (None when W&B is off or missing).
    """

    def __init__(self, config: LoggingConfig, output_dir: Path, run_config: dict[str, Any],
                 enabled: bool = True) -> None:
        self.config = config
        self.enabled = enabled
        self.jsonl_path = output_dir / "metrics.jsonl" if enabled and config.jsonl else None
        self.wandb_run = None
        self.wandb_dir: str | None = None
        if enabled and config.wandb:
            self._start_wandb(output_dir, run_config)

    def _start_wandb(self, output_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            print("tandem: wandb is not installed (pip install 'tandem-rollout[train]'); "
                  "logging to the console and JSONL only.", file=sys.stderr)
            return
        mode = os.environ.get("WANDB_MODE", self.config.wandb_mode)
        self.wandb_run = wandb.init(project=self.config.wandb_project, mode=mode,
                                    dir=str(output_dir), config=run_config)
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
                     "sampler_logprob_diff_max", "rollout_tok_per_s", "sync_seconds")
            parts = [f"{key}={metrics[key]:.4g}" for key in shown if key in metrics]
            tqdm.write(f"step {step}: " + " ".join(parts))

    def finish(self) -> None:
        """Close the W&B run."""
        if self.wandb_run is not None:
            self.wandb_run.finish()
