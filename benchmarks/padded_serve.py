"""``tandem serve`` with every forward step padded to ``SERVE_OVERHEAD_STEP_MS`` milliseconds
(serve_overhead.py's server), in every process that steps the engine.

The padding is applied when this module is imported, and the server's engine core process
(multiprocessing's ``spawn``) imports the parent's main module again, as ``__mp_main__``,
before it builds the engine: run as the main script, this file pads the API process and
the core process alike, with no hook in the server.

Run::

    SERVE_OVERHEAD_STEP_MS=6 python padded_serve.py serve MODEL_DIR --port 8000
"""

from __future__ import annotations

import os
import sys
import time

from tandem.rollout.worker.model_runner import ModelRunner

STEP_MS_VARIABLE = "SERVE_OVERHEAD_STEP_MS"


def pad_steps(step_ms: float) -> None:
    """Make every forward step of this process take at least ``step_ms`` milliseconds."""
    run_step = ModelRunner.run_step

    def padded(self, step):
        start = time.perf_counter()
        logits = run_step(self, step)
        time.sleep(max(0.0, step_ms / 1e3 - (time.perf_counter() - start)))
        return logits

    ModelRunner.run_step = padded


if STEP_MS_VARIABLE in os.environ:
    pad_steps(float(os.environ[STEP_MS_VARIABLE]))

if __name__ == "__main__":
    from tandem.cli import main

    sys.exit(main(sys.argv[1:]))
