#!/usr/bin/env bash
# Two trees on this CPU in one session, alternated: bench/overhead.py --batch 256, then bench/throughput.py.
#   git worktree add /tmp/basewt BASE_COMMIT && bash bench/compare_cpu.sh /tmp/basewt
# Each tree is installed editable into the active venv in turn; the current tree is reinstalled at the end.
set -u
current=$(pwd)
base=${1:?usage: bash bench/compare_cpu.sh BASE_TREE}
for round in 1 2; do
  for tree in "$base" "$current"; do
    name=$([ "$tree" = "$current" ] && echo current || echo base)
    (cd "$tree" && pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
    echo "=== round $round $name overhead"
    (cd "$tree" && python bench/overhead.py --batch 256 2>&1 | tail -3)
    echo "=== round $round $name throughput"
    (cd "$tree" && python bench/throughput.py --json "/tmp/cpu_${name}_${round}.json" 2>&1 | tail -8)
  done
done
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
