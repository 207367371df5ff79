#!/usr/bin/env bash
# The one-call GPU check (see benchmarks/gpu_check.py): kernel errors, decode attention
# bandwidth, eager against CUDA graphs, nano-bench against transformers' generate, and TP=2
# against TP=1 when two GPUs are present (recorded as skipped otherwise).
# Usage: benchmarks/gpu_check.sh OUT_DIR [--smoke]   (at most 5 minutes on one GPU;
# --smoke runs toy sizes on a CPU to check the script itself)
set -u
out="$(mkdir -p "${1:?usage: benchmarks/gpu_check.sh OUT_DIR [--smoke]}" && cd "$1" && pwd)"
shift
cd "$(dirname "$0")/.."
# Import this working tree as `tandem` whether or not it is pip-installed (the GPU image
# has no package registry): a folder of links mapping tandem.<part> to the code folders.
links="$(mktemp -d)"
mkdir -p "$links/tandem"
for part in rollout kernels sync trainers; do
    ln -s "$PWD/$part" "$links/tandem/$part"
done
export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY' 2>&1 | tee "$out/environment.txt"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
# The run keeps its own 280 s budget; the hard limit leaves time to print what it recorded.
timeout -k 5 290 python benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "gpu_check.py exited with $status; the results recorded so far:"
    python benchmarks/gpu_check.py "$out" --table
fi
exit "$status"
