"""bench/gpu.py with every step laid out by the per-token lists (the device layout off)."""
import runpy, sys
from pathlib import Path
import zoo.model_runner as mr
mr.device_lays_out = lambda entry: False
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "bench" / "gpu.py")
sys.path.insert(0, str(Path(sys.argv[0]).parent))
runpy.run_path(sys.argv[0], run_name="__main__")
