#!/usr/bin/env bash
# One GPU session on the lent device machine: the base commit and the current tree side by side.
#
# Run from the repository root, with the git-ignored folder .carry/ carried along (bash bench/prepare_carry.sh fills it):
#   .carry/wheels/    hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3 (the device has no network
#                     and lacks them); pluggy, setuptools, wheel (installed only where the device's are missing or old);
#                     peft, accelerate, psutil (the adapter tests' peer; installed only where missing)
#   .carry/base/      `git archive <base commit>` of this repository
#   .carry/gpt_fast/  shared/anchors/gpt_fast (only for the optional `anchor` part)
#
#   bash bench/gpu_session.sh --quick        install, then import zoo and list its plugins for both trees
#   bash bench/gpu_session.sh [PART ...]     PART: gpu cpu tests anchor spec lora; default: gpu cpu tests
#                                            `spec` = bench/speculative_gpu.py (SPEC_ARGS, SPEC_CAP_S)
#                                            `lora` = bench/lora_gpu.py (LORA_ARGS, LORA_CAP_S)
#                                            `profile` = bench/profile_gpu_step.py (PROFILE_ARGS, PROFILE_CAP_S)
#                                            `gemv` = bench/gemv_kernel.py (GEMV_ARGS, GEMV_CAP_S)
#                                            `mlp` = bench/mlp_split_k.py (MLP_ARGS, MLP_CAP_S): the MLP as one
#                                            split-K launch against two, first of the parts
#                                            `norm_gemv` = bench/norm_gemv.py (the norm folded into the GEMV)
#                                            `barrier` = bench/grid_barrier.py (BARRIER_ARGS, BARRIER_CAP_S): a
#                                            kernel boundary against a persistent kernel's grid barrier
#                                            `offline` = bench/profile_offline.py (OFFLINE_ARGS, OFFLINE_CAP_S)
#                                            `arrivals` = bench/arrivals.py --llama-1b (ARRIVALS_ARGS, default:
#                                            mixed graphs against none; ARRIVALS_CAP_S)
#                                            `serve` = bench/serve.py --llama-1b (SERVE_ARGS, SERVE_CAP_S; needs
#                                            the serve extra's wheels in .carry/wheels; SERVE_ARGS_B and
#                                            SERVE_ARGS_C: more runs in the same call, to serve/serve_b.*, _c.*)
#                                            `bench` = gpu cpu
#
# Both trees are installed the same way for the benchmarks: non-editable, with --no-deps, into their own
# --target folders (/tmp/zoo_base, /tmp/zoo_current) put first on PYTHONPATH, so the two never clash and
# each one's dist-info registers its own `zoo.plugins` entry points. The tests need zoo in site-packages
# (their subprocesses replace PYTHONPATH), so the `tests` part installs the current tree editable then;
# every call starts by removing any zoo-runtime left in site-packages by an earlier call.
#
# Environment knobs: ROUNDS (gpu.py runs per tree, interleaved base/current then current/base; default 2),
# GPU_TREES (default "base current"; "current" skips the base tree), GPU_CAP_S (per gpu.py run; default 300),
# GPU_ARGS (default --skip-hf), GPU_ARGS_B (the even rounds' arguments instead, for an A/B in one call), CPU_ARGS (extra bench/throughput.py arguments; default none),
# DEADLINE_S (stop starting work after this many seconds; default 570, under the run tool's 600 s limit),
# PY (default python3), FORCE_DEPS_TARGET=1 (test the fallback that installs the wheels into /tmp/zoo_deps).
#
# Output in $OUT (at most 8 files come back from the device; two folder levels):
#   base/gpu_rounds.json, current/gpu_rounds.json      list of bench/gpu.py records, one per round
#   base/throughput.json, current/throughput.json      bench/throughput.py --json
#   pytest_cuda.txt                                    test_gpu.py, then the whole suite with -x (PYTEST_X= : without; SUITE=0: test_gpu.py only; GPU_TESTS: other files for that first part, GPU_TESTS_CAP_S its time (240 s), GPU_TESTS_ARGS more pytest arguments for it, e.g. "-n 2 --dist loadfile"; SUITE_ARGS: more pytest arguments for the suite, e.g. "-n 2 --dist loadfile": the device has pytest-xdist; four workers ran engine-heavy files out of an H100's memory)
#   summary.txt                                        the table printed at the end
#   logs.tgz                                           every log, gpu.md/png, pip output, the environment
#   results.tgz                                        where the parts wrote more than 8 files: all but the three above

set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-python3}
OUT=${OUT:-/tmp/zoo_session_out}
STAGE=/tmp/zoo_session
ROUNDS=${ROUNDS:-2}
GPU_ARGS=${GPU_ARGS:---skip-hf}
CPU_ARGS=${CPU_ARGS:-}
DEADLINE_S=${DEADLINE_S:-570}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset PYTHONPATH

# The device's copy of the checkout carries a .git of an earlier sync (round 15's calls all named a34d481 while the
# tree sent was later), so the environment also names the tree by its files' contents: `bash bench/gpu_session.sh
# fingerprint` prints the same figure here for the same files.
tree_fingerprint() {
  (cd "$ROOT" && find zoo plugins conf bench tests -type f \( -name '*.py' -o -name '*.yaml' -o -name '*.sh' \) \
     -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
}
[ "${1:-}" = fingerprint ] && { tree_fingerprint; exit 0; }

QUICK=0
PARTS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    bench) PARTS+=(gpu cpu) ;;
    all) PARTS+=(gpu cpu tests) ;;
    gpu|cpu|tests|anchor|spec|lora|profile|gemv|mlp|norm_gemv|barrier|serve|offline|arrivals) PARTS+=("$a") ;;
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    *) echo "unknown argument: $a (see --help)"; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(gpu cpu tests)
want() { local p; for p in "${PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

rm -rf "$STAGE"
mkdir -p "$STAGE/base" "$STAGE/current" "$OUT/base" "$OUT/current"
STATUS=$STAGE/status.txt
: > "$STATUS"

note() { echo "[$(date +%H:%M:%S) +$((SECONDS))s] $*"; }
pack() { tar -czf "$OUT/logs.tgz" -C "$STAGE" . 2>/dev/null; }
status() { echo "$*" | tee -a "$STATUS"; pack; }

# run_part NAME CAP_S LOG CMD...: runs CMD with its output in LOG, under `timeout` of the smaller of CAP_S and
# what is left before DEADLINE_S; skipped when under 20 s is left. Never stops the script.
run_part() {
  local name=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE_S - SECONDS))
  if [ "$left" -lt 20 ]; then status "SKIP  $name (only ${left}s left before DEADLINE_S=$DEADLINE_S)"; return 99; fi
  [ "$cap" -gt "$left" ] && cap=$left
  note "start $name (limit ${cap}s) -> $log"
  local t0=$SECONDS rc
  # bash -c: CMD may be one of this script's functions (exported below); timeout runs programs only
  timeout -k 10 "$cap" bash -c '"$@"' run_part "$@" > "$log" 2>&1
  rc=$?
  local word=ok; [ $rc -ne 0 ] && word=FAIL; [ $rc -eq 124 ] && word=TIMEOUT
  status "$(printf '%-7s %-28s rc=%-3s %4ss' "$word" "$name" "$rc" "$((SECONDS - t0))")"
  if [ $rc -ne 0 ]; then echo "--- last lines of $log:"; tail -n 15 "$log"; echo "---"; fi
  return $rc
}

# ---------------------------------------------------------------- environment and installs
note "session: parts=${PARTS[*]} quick=$QUICK rounds=$ROUNDS gpu_args='$GPU_ARGS' out=$OUT"
{
  echo "date: $(date -u)"; echo "python: $(command -v "$PY")"; "$PY" --version
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv 2>&1
  "$PY" -c "import torch, triton, transformers, setuptools, pip; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else ''); print('triton', triton.__version__, 'transformers', transformers.__version__, 'setuptools', setuptools.__version__, 'pip', pip.__version__)" 2>&1
  nproc; free -g | head -2
  echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) (the .git sent, maybe older than the tree);" \
    "tree fingerprint $(tree_fingerprint) (bash bench/gpu_session.sh fingerprint)"
} > "$STAGE/env.txt" 2>&1
cat "$STAGE/env.txt"

install_deps() {
  "$PY" -m pip uninstall -y -q zoo-runtime 2>/dev/null  # a warm machine may still hold an earlier call's install
  "$PY" -m pip install --no-index --find-links "$ROOT/.carry/wheels" --no-cache-dir \
    hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 || return 1
  if ! "$PY" -c "import sys, pluggy; sys.exit(tuple(map(int, pluggy.__version__.split('.')[:2])) < (1, 5))"; then
    "$PY" -m pip install --no-index --find-links "$ROOT/.carry/wheels" --no-cache-dir pluggy || return 1
  fi
  # the --no-build-isolation builds below need setuptools >= 64 (editable installs) and a bdist_wheel command
  if ! "$PY" -c "import sys, setuptools; from importlib.util import find_spec
sys.exit(not (int(setuptools.__version__.split('.')[0]) >= 64
              and (find_spec('wheel') or find_spec('setuptools.command.bdist_wheel'))))"; then
    "$PY" -m pip install --no-index --find-links "$ROOT/.carry/wheels" --no-cache-dir setuptools==80.9.0 wheel==0.45.1 || return 1
  fi
  # peft, the peer of the adapter tests (with accelerate and psutil where the device lacks them)
  for pkg in psutil accelerate peft; do
    "$PY" -c "import $pkg" 2>/dev/null || "$PY" -m pip install --no-index --no-deps --find-links "$ROOT/.carry/wheels" \
      --no-cache-dir "$pkg" || echo "note: $pkg not installed (the adapter tests need peft)"
  done
  "$PY" -c "import hydra, omegaconf, antlr4, pluggy, setuptools; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__, 'pluggy', pluggy.__version__, 'setuptools', setuptools.__version__)"
}
# install_deps_target: the fallback where the interpreter's site-packages cannot be written: the same wheels
# into /tmp/zoo_deps, which then goes on PYTHONPATH behind each tree (DEPS_PATH)
install_deps_target() {
  local w=$ROOT/.carry/wheels
  local wheels=("$w"/hydra_core-*.whl "$w"/omegaconf-*.whl "$w"/antlr4_python3_runtime-*.whl)
  "$PY" -c "import sys, pluggy; sys.exit(tuple(map(int, pluggy.__version__.split('.')[:2])) < (1, 5))" \
    || wheels+=("$w"/pluggy-*.whl)
  "$PY" -c "import sys, setuptools; from importlib.util import find_spec
sys.exit(not (int(setuptools.__version__.split('.')[0]) >= 64
              and (find_spec('wheel') or find_spec('setuptools.command.bdist_wheel'))))" \
    || wheels+=("$w"/setuptools-*.whl "$w"/wheel-*.whl)
  rm -rf /tmp/zoo_deps
  "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target /tmp/zoo_deps "${wheels[@]}" || return 1
  PYTHONPATH=/tmp/zoo_deps "$PY" -c "import hydra, omegaconf, antlr4, pluggy, setuptools; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__, 'pluggy', pluggy.__version__, 'setuptools', setuptools.__version__)"
}
# install_target TREE DEST: a non-editable copy of TREE (built from a scratch copy, so TREE stays clean)
install_target() {
  local tree=$1 dest=$2 src=/tmp/zoo_src_$(basename "$2")
  rm -rf "$dest" "$src"; mkdir -p "$src"
  tar -C "$tree" --exclude=./.git --exclude=./.carry --exclude=./.venv --exclude=./build --exclude='*.egg-info' \
    --exclude=__pycache__ -cf - . | tar -C "$src" -xf -
  PYTHONPATH=$DEPS_PATH "$PY" -m pip install --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --target "$dest" "$src"
}
install_editable() {
  PYTHONPATH=$DEPS_PATH "$PY" -m pip install --no-deps --no-build-isolation --no-cache-dir -e "$ROOT"
}

PLUGIN_CHECK='import importlib.metadata as md, zoo
from zoo.plugins import load_plugins
print("zoo from", zoo.__file__)
print("entry points:", sorted(ep.name for ep in md.entry_points(group="zoo.plugins")))
print(sorted(n for n, _ in load_plugins().list_name_plugin()))'
# with_tree NAME CMD...: run CMD with that tree's --target install first on PYTHONPATH (scripts only: a
# `python -c` or `-m` run from a tree's root would import that root's zoo/ first)
with_tree() { local t=$1; shift; PYTHONPATH=/tmp/zoo_$t${DEPS_PATH:+:$DEPS_PATH} "$@"; }

DEPS_PATH=
export PY ROOT STAGE OUT DEPS_PATH
export -f install_deps install_deps_target install_target install_editable with_tree

SERVE_EXTRA="fastapi uvicorn uvloop httptools jinja2 prometheus_client"
install_carried() {  # install_carried PKG...: those the device lacks, from the carried wheels
  local pkg
  for pkg in "$@"; do
    "$PY" -c "import $pkg" 2>/dev/null || "$PY" -m pip install --no-index --find-links "$ROOT/.carry/wheels" \
      --no-cache-dir "$pkg" > "$STAGE/install_$pkg.log" 2>&1 || echo "note: $pkg not installed"
  done
}

run_part install_deps 240 "$STAGE/install_deps.log" install_deps
if [ -n "${FORCE_DEPS_TARGET:-}" ] || ! "$PY" -c "import hydra, omegaconf, pluggy" 2>/dev/null; then
  run_part install_deps_target 240 "$STAGE/install_deps_target.log" install_deps_target
  DEPS_PATH=/tmp/zoo_deps
  status "note    dependencies from PYTHONPATH=$DEPS_PATH (site-packages install failed or FORCE_DEPS_TARGET)"
fi
GPU_TREES=${GPU_TREES:-base current}
if { want gpu && [ "$GPU_TREES" != current ]; } || want cpu; then
  run_part install_base 120 "$STAGE/install_base.log" install_target "$ROOT/.carry/base" /tmp/zoo_base
fi
run_part install_current 120 "$STAGE/install_current.log" install_target "$ROOT" /tmp/zoo_current

if [ $QUICK -eq 1 ]; then
  for t in base current; do
    echo "=== $t (--target /tmp/zoo_$t)"
    (cd /tmp && with_tree "$t" "$PY" -c "$PLUGIN_CHECK") 2>&1 | tee "$STAGE/$t/quick.txt" | tail -n 20
    echo "rc=${PIPESTATUS[0]}"
  done
  echo "=== current, editable install into site-packages (what the tests part uses)"
  run_part install_editable 120 "$STAGE/install_editable.log" install_editable
  (cd /tmp && PYTHONPATH=$DEPS_PATH "$PY" -c "$PLUGIN_CHECK") 2>&1 | tee "$STAGE/current/quick_editable.txt" | tail -n 20
  echo "rc=${PIPESTATUS[0]}"
  "$PY" -m pip uninstall -y -q zoo-runtime
  cp "$STAGE"/install_*.log "$STAGE/env.txt" "$OUT/" 2>/dev/null
  rm -rf "$OUT/base" "$OUT/current"
  pack
  echo "=== status"; cat "$STATUS"
  exit 0
fi

# ---------------------------------------------------------------- (a) GPU benchmark, both trees, interleaved
gpu_round() {  # gpu_round TREE ROUND
  local t=$1 r=$2 script dir=$STAGE/$1/gpu_r$2 args=$GPU_ARGS
  if [ "$t" = base ]; then script=$ROOT/.carry/base/bench/gpu.py; else script=$ROOT/bench/gpu.py; fi
  [ $((r % 2)) -eq 0 ] && [ -n "${GPU_ARGS_B:-}" ] && args=$GPU_ARGS_B
  # shellcheck disable=SC2086
  run_part "gpu $t r$r" "${GPU_CAP_S:-300}" "$STAGE/$t/gpu_r$r.log" with_tree "$t" "$PY" "$script" $args --out "$dir"
  cp "$dir"/gpu.md "$dir"/gpu.png "$OUT/$t/" 2>/dev/null
}
if want gpu; then
  for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then order="base current"; else order="current base"; fi
    [ "$GPU_TREES" = current ] && order=current
    for t in $order; do gpu_round "$t" "$r"; done
    "$PY" - "$STAGE" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
stage, out = Path(sys.argv[1]), Path(sys.argv[2])
for t in ("base", "current"):
    recs = [json.loads(p.read_text()) for p in sorted((stage / t).glob("gpu_r*/gpu.json"))]
    (out / t / "gpu_rounds.json").write_text(json.dumps(recs, indent=1))
EOF
    pack
  done
fi

# ---------------------------------------------------------------- (b) CPU benchmark, both trees
if want cpu; then
  for t in base current; do
    if [ "$t" = base ]; then script=$ROOT/.carry/base/bench/throughput.py; else script=$ROOT/bench/throughput.py; fi
    # shellcheck disable=SC2086
    run_part "throughput $t" 150 "$STAGE/$t/throughput.log" \
      with_tree "$t" "$PY" "$script" $CPU_ARGS --json "$STAGE/$t/throughput.json"
    cp "$STAGE/$t/throughput.json" "$OUT/$t/throughput.json" 2>/dev/null
  done
fi

# ---------------------------------------------------------------- optional: where the decode step's time goes
# bench_part NAME CAP_S SCRIPT FOLDER ARGS...: bench/SCRIPT on the current tree, with --out $OUT/FOLDER and its
# log in $OUT/FOLDER/FOLDER.log
bench_part() {
  local name=$1 cap=$2 script=$3 folder=$4; shift 4
  mkdir -p "$OUT/$folder"
  run_part "$name" "$cap" "$OUT/$folder/$folder.log" with_tree current "$PY" "$ROOT/bench/$script" --out "$OUT/$folder" "$@"
}
# shellcheck disable=SC2086
want mlp && run_part "mlp_split_k" "${MLP_CAP_S:-200}" "$STAGE/mlp_split_k.log" \
  with_tree current "$PY" "$ROOT/bench/mlp_split_k.py" --out "$OUT/mlp_split_k.txt" ${MLP_ARGS:-}
# shellcheck disable=SC2086
want profile && bench_part profile_gpu_step "${PROFILE_CAP_S:-300}" profile_gpu_step.py profile ${PROFILE_ARGS:-}
if want gemv; then
  # shellcheck disable=SC2086
  run_part "gemv_kernel" "${GEMV_CAP_S:-200}" "$STAGE/gemv.log" \
    with_tree current "$PY" "$ROOT/bench/gemv_kernel.py" --out "$OUT/gemv.txt" ${GEMV_ARGS:-}
fi
want norm_gemv && run_part "norm_gemv" 120 "$STAGE/norm_gemv.log" \
  with_tree current "$PY" "$ROOT/bench/norm_gemv.py" --out "$OUT/norm_gemv.txt"
want barrier && run_part "grid_barrier" "${BARRIER_CAP_S:-150}" "$OUT/grid_barrier.txt" \
  with_tree current "$PY" "$ROOT/bench/grid_barrier.py" --out "$OUT/grid_barrier.json" ${BARRIER_ARGS:-}

# shellcheck disable=SC2086
want offline && bench_part profile_offline "${OFFLINE_CAP_S:-300}" profile_offline.py offline ${OFFLINE_ARGS:-}
# shellcheck disable=SC2086
want arrivals && run_part "arrivals" "${ARRIVALS_CAP_S:-300}" "$OUT/arrivals.txt" \
  with_tree current "$PY" "$ROOT/bench/arrivals.py" --llama-1b ${ARRIVALS_ARGS:---variants default mixed_graph_tokens=512}

if want serve; then
  mkdir -p "$OUT/serve"
  # shellcheck disable=SC2086
  install_carried $SERVE_EXTRA aiohttp  # bench/serve.py's clients
  command -v py-spy > /dev/null || "$PY" -m pip install --no-index --find-links "$ROOT/.carry/wheels" --no-cache-dir \
    py-spy > "$STAGE/install_py-spy.log" 2>&1 || echo "note: py-spy not installed (serve.py --py-spy needs it)"
  # shellcheck disable=SC2086
  run_part "serve_bench" "${SERVE_CAP_S:-300}" "$OUT/serve/serve.log" \
    with_tree current "$PY" "$ROOT/bench/serve.py" --llama-1b --out "$OUT/serve/serve.json" --server-log "$OUT/serve/server.log" ${SERVE_ARGS:-}
  for side in b c; do  # SERVE_ARGS_B, SERVE_ARGS_C: more configurations in the same call, for A/Bs on one machine
    var=SERVE_ARGS_${side^^}
    [ -n "${!var:-}" ] || continue
    # shellcheck disable=SC2086
    run_part "serve_bench_$side" "${SERVE_CAP_S:-300}" "$OUT/serve/serve_$side.log" \
      with_tree current "$PY" "$ROOT/bench/serve.py" --llama-1b --out "$OUT/serve/serve_$side.json" ${!var}
  done
fi

# ---------------------------------------------------------------- (c) tests on CUDA, current tree
if want tests; then
  [ -n "$DEPS_PATH" ] && export PYTHONPATH=$DEPS_PATH
  # shellcheck disable=SC2086
  install_carried $SERVE_EXTRA openai httpx aiohttp  # or tests/test_serve.py skips, and bench/serve.py's smoke test fails
  if ! run_part install_editable 120 "$STAGE/install_editable.log" install_editable; then
    export PYTHONPATH=/tmp/zoo_current${DEPS_PATH:+:$DEPS_PATH}  # the --target copy registers the entry points
    status "note    tests use PYTHONPATH=$PYTHONPATH (editable install failed)"
  fi
  : > "$OUT/pytest_cuda.txt"
  pytest_cuda() {  # pytest_cuda TITLE ARGS...: appends to $OUT/pytest_cuda.txt
    local title=$1; shift
    echo "=== ZOO_DEVICE=cuda python -m pytest $* ($title)" >> "$OUT/pytest_cuda.txt"
    ZOO_DEVICE=cuda "$PY" -m pytest "$@" 2>&1 | tee -a "$OUT/pytest_cuda.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== rc=$rc" >> "$OUT/pytest_cuda.txt"
    return "$rc"
  }
  export -f pytest_cuda
  run_part "pytest test_gpu.py" "${GPU_TESTS_CAP_S:-240}" "$STAGE/pytest_gpu.log" pytest_cuda test_gpu -q -p no:cacheprovider ${GPU_TESTS_ARGS:-} ${GPU_TESTS:-tests/test_gpu.py}
  # shellcheck disable=SC2086
  [ "${SUITE:-1}" = 1 ] && run_part "pytest tests" 540 "$STAGE/pytest_all.log" pytest_cuda suite -q ${PYTEST_X--x} -p no:cacheprovider ${SUITE_ARGS:-} tests
fi

# ---------------------------------------------------------------- optional: speculative decoding end to end
# shellcheck disable=SC2086
want spec && bench_part speculative_gpu "${SPEC_CAP_S:-540}" speculative_gpu.py spec ${SPEC_ARGS:-}

# ---------------------------------------------------------------- optional: LoRA decode speed
# shellcheck disable=SC2086
want lora && bench_part lora_gpu "${LORA_CAP_S:-300}" lora_gpu.py lora ${LORA_ARGS:-}

# ---------------------------------------------------------------- optional: gpt-fast anchor (not in the default)
if want anchor; then
  run_part "anchor gpt_fast 1 64" 240 "$STAGE/anchor.log" "$PY" "$ROOT/.carry/gpt_fast/anchor.py" 1 64
fi

# ---------------------------------------------------------------- summary
"$PY" - "$STAGE" "$OUT" "$STATUS" <<'EOF' > "$OUT/summary.txt" 2>&1
import json, statistics, sys
from pathlib import Path
stage, out, status = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
print("parts:")
print(status.read_text().rstrip())
recs = {}
for t in ("base", "current"):
    p = out / t / "gpu_rounds.json"
    recs[t] = json.loads(p.read_text()) if p.exists() else []
def med(xs):
    return statistics.median(xs) if xs else float("nan")
if any(recs.values()):
    print("\nbench/gpu.py (zoo; median over rounds, each round in brackets):")
    rows = [(f"decode tok/s b{b}", lambda r, b=b: r["zoo_sweep"][b]["decode_tok_s"]) for b in ("1", "8", "32", "64")]
    rows += [("roofline % b1", lambda r: 100 * r["zoo_sweep"]["1"]["roofline_fraction"]),
             ("roofline % b64", lambda r: 100 * r["zoo_sweep"]["64"]["roofline_fraction"]),
             ("offline out tok/s", lambda r: r["zoo_offline"]["output_tok_s"]),
             ("startup s", lambda r: r["zoo_startup_s"]),
             ("copy TB/s", lambda r: r["copy_bandwidth_TBps"])]
    print(f"{'':20} {'base':>28} {'current':>28} {'cur/base':>8}")
    for name, get in rows:
        cells, meds = [], []
        for t in ("base", "current"):
            try:
                vals = [get(r) for r in recs[t]]
            except (KeyError, TypeError):
                vals = []
            meds.append(med(vals))
            cells.append(f"{med(vals):.1f} [{' '.join(f'{v:.0f}' if v > 100 else f'{v:.2f}' for v in vals)}]")
        ratio = meds[1] / meds[0] if meds[0] == meds[0] and meds[0] else float("nan")
        print(f"{name:20} {cells[0]:>28} {cells[1]:>28} {ratio:8.3f}")
    for t in ("base", "current"):
        for r in recs[t]:
            print(f"  {t}: graphs {r.get('zoo_cuda_graphs')} fused {r.get('zoo_fused_ops')} "
                  f"kv_blocks {r.get('zoo_kv_blocks')} preemptions {r.get('zoo_offline', {}).get('preemptions')}")
tp = {t: out / t / "throughput.json" for t in ("base", "current")}
if any(p.exists() for p in tp.values()):
    print("\nbench/throughput.py (CPU, its defaults): prefill s, decode tok/s, end-to-end tok/s (best of repeats)")
    for t, p in tp.items():
        if not p.exists():
            print(f"  {t}: missing"); continue
        d = json.loads(p.read_text())
        for name, r in d.get("results", {}).items():
            print(f"  {t:8} {name:13} prefill {r['prefill_s']:.3f} s  decode {r['decode_tok_s']:8.1f}  "
                  f"e2e {r['e2e_tok_s']:8.1f}")
        print(f"  {t:8} zoo/transformers decode x{d['ratios_zoo_over_transformers']['decode_tok_s']:.2f}, "
              f"tokens match {d['tokens_match']['match']}, threads {d['env']['threads']}")
p = out / "pytest_cuda.txt"
if p.exists():
    print("\npytest on CUDA:")
    import re
    for line in p.read_text().splitlines():
        if line.startswith(("=== ", "FAILED", "ERROR")) or re.search(r"\b\d+ (passed|failed|skipped|errors?)\b", line):
            print("  " + line[:200])
EOF
cat "$OUT/summary.txt"
pack
# The device returns at most 8 files from $OUT: past that, everything but the summary, the test output and the
# logs goes back in one archive (round 12 lost a profile's log and table to the limit).
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name pytest_cuda.txt ! -name logs.tgz ! -name results.tgz -print0 \
     | tar -czf results.tgz --null -T - --remove-files && find . -type d -empty -delete)
  note "more than 8 files in $OUT: packed into results.tgz"
fi
note "done"
