#!/usr/bin/env bash
# The one-call GPU check on a bare GPU machine (see benchmarks/gpu_check.py for the sections).
# Installs the project with pip (offline: no dependencies, no build isolation), falling back to
# PYTHONPATH=src; installs the wheels benchmarks/gpu_wheels.sh downloaded into WHEELS (default
# .whl) with pip --no-index --target; then runs the check, writing at most 8 files to OUT_DIR.
# Usage: benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options: --smoke, --budget S, --only ...]
# (about 7 minutes on one H200; --smoke runs toy sizes on a CPU to check the script itself)
set -u
out="$(mkdir -p "${1:?usage: benchmarks/gpu_check.sh OUT_DIR [options]}" && cd "$1" && pwd)"
shift
cd "$(dirname "$0")/.."
wheels="${WHEELS:-.whl}"
{
    if python3 -c "import tandem.rollout" 2>/dev/null; then
        echo "tandem: already importable"
    elif python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1; then
        echo "tandem: pip install -e ."
    else
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
        echo "tandem: pip install failed; PYTHONPATH=src"
    fi
    if compgen -G "$wheels/*.whl" >/dev/null; then
        site="$(mktemp -d)/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl 2>&1 && echo "wheels: $wheels -> $site"
        export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
    else
        echo "wheels: none in $wheels (run benchmarks/gpu_wheels.sh $wheels here first)"
    fi
    python3 - <<'PY'
import importlib
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("fastapi", "uvicorn", "xgrammar", "aiohttp", "peft"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 - report what is missing, go on
        print(name, "missing:", type(error).__name__, error)
PY
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"
export PYTHONUNBUFFERED=1
# The run keeps its own budget (gpu_check.py --budget, 400 s on a GPU); the hard limit
# (CHECK_TIMEOUT, 440 s) stops a hung section and leaves time to print what was recorded.
timeout -k 5 "${CHECK_TIMEOUT:-440}" python3 benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "gpu_check.py exited with $status; the results recorded so far:"
    python3 benchmarks/gpu_check.py "$out" --table
fi
exit "$status"
