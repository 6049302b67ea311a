# Which of the split-K tile, PDL and WEIGHTS_FIRST makes the fp32 model tests fail on CUDA (round 19, call 3).
python3 -m pip install -q --no-index --find-links .carry/wheels hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 2>&1 | tail -2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import hydra, zoo; print(zoo.__file__)"
export ZOO_DEVICE=cuda
K='llama-64-True-True or narrow_tiles_matches_transformers or mlp_split_k_adds'
for variant in "64,128,256,3,4 1 1" "32,64,64,3,4 1 1" "64,128,256,3,4 0 1"; do
  set -- $variant
  echo "=== config ($1) PDL=$2 WEIGHTS_FIRST=$3"
  timeout 90 python3 - "$1" "$2" "$3" "$K" <<'PY' 2>&1 | grep -E "passed|failed|FAILED|Error|assert \[" | head -12
import sys
import pytest
import zoo.fused_ops as f
import zoo.triton_attention as t
f.MLP_SPLIT_K_CONFIG = tuple(int(v) for v in sys.argv[1].split(","))
t.PDL = sys.argv[2] == "1"
f.WEIGHTS_FIRST = sys.argv[3] == "1"
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rf", "--tb=line", "tests/test_fused_ops.py", "-k", sys.argv[4]]))
PY
done
