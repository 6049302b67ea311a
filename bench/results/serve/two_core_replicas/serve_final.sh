#!/usr/bin/env bash
# Issue 18's figures on the final code: PART=gpu (bench/serve.py --llama-1b, defaults) or PART=cpu2 (the whole
# benchmark, clients included, on two cores of the lent machine's CPU, as on the 2-core development machine).
set -u
PY=python3; export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
$PY -m pip install -q --no-deps --no-index --find-links .carry/wheels hydra-core omegaconf antlr4-python3-runtime pluggy >/dev/null 2>&1
for pkg in fastapi uvicorn uvloop httptools jinja2 prometheus_client aiohttp; do
  $PY -c "import $pkg" 2>/dev/null || $PY -m pip install -q --no-index --find-links .carry/wheels $pkg >/dev/null 2>&1 || echo "note: $pkg not installed"
done
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "zoo not installed"
git log -1 --format="code: %H %s" 2>/dev/null | tee $OUT/all.txt; nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $OUT/all.txt
run() {  # run NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a $OUT/all.txt
  timeout $limit "$@" > $OUT/$name.txt 2>&1
  echo "rc=$?" >> $OUT/$name.txt
  grep -E "^serve,|pair|LLM.generate,|serve / offline|rc=|Error|error|pinned|replicas" $OUT/$name.txt | tee -a $OUT/all.txt
}
if [ "$PART" = gpu ]; then
  run gpu_defaults 420 $PY bench/serve.py --llama-1b --concurrency 1 16 64 --interleave 4 --out $OUT/gpu_defaults.json
else
  export CUDA_VISIBLE_DEVICES=
  lscpu -e=CPU,CORE,SOCKET,NODE | head -5 | tee -a $OUT/all.txt; lscpu | grep -E "Model name|Thread" | tee -a $OUT/all.txt
  run cpu2_dp2_si8 260 taskset -c 0,1 $PY bench/serve.py --runtime device=cpu --concurrency 64 --interleave 8 --client-processes 1 --server-overrides server.data_parallel_size=2 server.stream_interval=8 --out $OUT/cpu2_dp2_si8.json
  run cpu2_defaults 260 taskset -c 0,1 $PY bench/serve.py --runtime device=cpu --concurrency 64 --interleave 8 --client-processes 1 --out $OUT/cpu2_defaults.json
fi
