#!/usr/bin/env bash
# Download, here (where pip reaches a registry), the wheels the GPU check needs beyond the GPU
# image's packages, for the image's Python 3.12 on x86-64 Linux: the serve extra (fastapi,
# starlette, pydantic with its core, uvicorn and their small dependencies; the image has
# anyio, click, h11, httpx, aiohttp, prometheus-client, peft and numpy) and the structured
# extra (xgrammar and apache-tvm-ffi). benchmarks/gpu_check.sh DIR installs them there.
# Usage: benchmarks/gpu_wheels.sh DIR   (DIR ignored by git, carried with the call)
set -euo pipefail
dir="${1:?usage: benchmarks/gpu_wheels.sh DIR}"
mkdir -p "$dir"
wheels=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
        uvicorn==0.55.0 annotated-types==0.8.0 typing-inspection==0.4.5
        opentelemetry-api==1.45.2 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
           manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dir" "${wheels[@]}"
ls "$dir"
