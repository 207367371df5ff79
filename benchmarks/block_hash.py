"""What the collision-safe prefix-cache key costs on grpo-cpu.

Runs Tandem's grpo-cpu call as ``grpo_cpu.py`` does (same workload, prompts, sampling and KV
pool; one untimed warm-up call) with ``block_hash`` wrapped to record every key it computes,
then replays those keys with the sha256 digest Tandem uses and with the 64-bit Python
``hash()`` of a tuple it replaced (which a crafted prompt can collide). The cost of the
digest is the difference, against the call's wall time; the checks a cache hit makes
(tokens, extra key, parent) are inside the timed call.

Run::

    python benchmarks/block_hash.py
    python benchmarks/block_hash.py --workload heavy
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from common import DTYPES, model_folder, print_table, setup_torch
from grpo_cpu import WORKLOADS, build_workload, tandem_call

from tandem.rollout.core import block_manager

Key = tuple[bytes | None, tuple[int, int | None], tuple[int, ...]]


def python_hash(parent: bytes | None, extra_key: tuple[int, int | None],
                token_ids: tuple[int, ...]) -> int:
    """The key Tandem used before: Python's 64-bit hash of the tuple."""
    return hash((parent, extra_key, token_ids))


def recorded_call(call: Callable[[], list[int]]) -> tuple[float, list[Key]]:
    """The call's wall seconds and every block key it computed."""
    keys: list[Key] = []
    digest = block_manager.block_hash

    def recording(*key: object) -> bytes:
        keys.append(key)
        return digest(*key)

    block_manager.block_hash = recording
    try:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start, keys
    finally:
        block_manager.block_hash = digest


def replay_seconds(function: Callable, keys: list[Key]) -> float:
    """Seconds to recompute every key with ``function``, the best of 5 rounds."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for key in keys:
            function(*key)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="grpo")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args()
    setup_torch()
    folder = model_folder()
    _, call = tandem_call(folder, args.dtype, build_workload(folder, args.workload, None))
    call()
    wall, keys = recorded_call(call)
    sha = replay_seconds(block_manager.block_hash, keys)
    old = replay_seconds(python_hash, keys)
    print(f"{args.workload} workload, {args.dtype}: {len(keys)} block keys in one call")
    print_table([
        ("key", "seconds per call", "us per key", "share of the call's wall time"),
        ("python hash() (before)", f"{old:.5f}", f"{old / len(keys) * 1e6:.2f}",
         f"{old / wall:.4%}"),
        ("sha256 (now)", f"{sha:.5f}", f"{sha / len(keys) * 1e6:.2f}", f"{sha / wall:.4%}"),
    ])
    print(f"call wall time {wall:.2f} s; the digest adds {(sha - old) / wall:.4%} of it")


if __name__ == "__main__":
    main()
