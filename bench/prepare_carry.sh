#!/usr/bin/env bash
# Fill the git-ignored folder .carry/ that bench/gpu_session.sh needs on the device machine, which reaches no
# package registry and lacks hydra, omegaconf and antlr4 (see the header of gpu_session.sh):
#   .carry/wheels/    wheels for the device's Python (3.12, manylinux x86_64): hydra-core, omegaconf, antlr4 (built
#                     here: it has no wheel on the registry), pluggy, setuptools, wheel, peft with accelerate and
#                     psutil, the serve extra with its needs, openai and httpx for the server's tests, aiohttp for
#                     bench/serve.py's clients, py-spy
#   .carry/gpt_fast/  ../shared/anchors/gpt_fast, the peer the GPU benchmark runs beside zoo (GPU_ARGS="--gpt-fast
#                     .carry/gpt_fast")
#
#   bash bench/prepare_carry.sh [DEST]     DEST defaults to .carry; PY (default python3) runs pip here
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-.carry}
PY=${PY:-python3}
mkdir -p "$DEST/wheels"
# pip matches each manylinux tag exactly: these cover the wheels the packages below publish
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_12_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$DEST/wheels" hydra-core==1.3.8 omegaconf==2.3.1 pyyaml pluggy setuptools==80.9.0 wheel==0.45.1 \
  peft accelerate psutil py-spy
# The serve extra with what it needs, resolved by pip: fastapi's requirements grow between releases (0.165 added
# opentelemetry-api, which a hand-kept list missed and the device could not install); and the clients that
# tests/test_serve.py drives the server with (openai, httpx: test extras the device lacks), and bench/serve.py's (aiohttp)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$DEST/wheels" fastapi uvicorn uvloop httptools jinja2 prometheus_client openai httpx aiohttp
"$PY" -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$DEST/wheels"
if [ -d ../shared/anchors/gpt_fast ]; then
  rm -rf "$DEST/gpt_fast" && cp -r ../shared/anchors/gpt_fast "$DEST/gpt_fast"
else
  echo "note: ../shared/anchors/gpt_fast not found; the gpt-fast side of bench/gpu.py needs it"
fi
ls "$DEST/wheels" | wc -l | xargs echo "wheels in $DEST/wheels:"
du -sh "$DEST" | cut -f1 | xargs echo "size (a device call carries at most 64 MiB with the tree):"
