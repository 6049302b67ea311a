#!/usr/bin/env bash
# bench/serve.py on the device machine's CPU (16 cores): the server's processes and LLM.generate pinned to the same
# cores, the load generator on the others, so the clients take nothing from the system under test.
set -u
PY=python3; export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=
$PY -m pip install -q --no-deps --no-index --find-links .carry/wheels hydra-core omegaconf antlr4-python3-runtime pluggy >/dev/null 2>&1
for pkg in fastapi uvicorn uvloop httptools jinja2 prometheus_client aiohttp; do
  $PY -c "import $pkg" 2>/dev/null || $PY -m pip install -q --no-index --find-links .carry/wheels $pkg >/dev/null 2>&1 || echo "note: $pkg not installed"
done
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "zoo not installed"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz" ; nproc
run() {  # run NAME ARGS...
  local name=$1; shift
  echo "=== $name: python bench/serve.py --runtime device=cpu $*" | tee -a $OUT/all.txt
  timeout 110 $PY bench/serve.py --runtime device=cpu --out $OUT/$name.json "$@" > $OUT/$name.txt 2>&1
  echo "rc=$?" >> $OUT/$name.txt
  grep -E "^serve,|pair|LLM.generate,|serve / offline|rc=|Error|error" $OUT/$name.txt | tee -a $OUT/all.txt
}
run dp2_pinned2_of3 --concurrency 64 --interleave 6 --server-cpus 0 1 2 --engine-cpus 0 1 --server-overrides server.data_parallel_size=2
run pinned2_of3 --concurrency 64 --interleave 6 --server-cpus 0 1 2 --engine-cpus 0 1
cd $OUT && tar czf json.tgz *.json && rm -f *.json
