"""bench/throughput.py runs end to end on a tiny model and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"


def test_throughput_script_runs(tmp_path):
    out = tmp_path / "result.json"
    args = [sys.executable, str(SCRIPT), "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "4",
            "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
            "--intermediate-size", "128", "--vocab-size", "300", "--max-position", "256",
            "--repeats", "1", "--warmup-tokens", "2", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zoo/transformers" in proc.stdout
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"transformers", "zoo"}
    for result in record["results"].values():
        assert result["full_s"] > 0 and result["e2e_tok_s"] > 0
    assert record["tokens_match"]["match"], record["tokens_match"]
    assert record["zoo_engine_stats"]["prefix_hit_tokens"] == 0
    assert record["ratios_zoo_over_transformers"]["e2e_tok_s"] > 0


def test_speculative_script_runs(tmp_path):
    out = tmp_path / "spec.json"
    script = SCRIPT.parent / "speculative.py"
    args = [sys.executable, str(script), "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "8",
            "--hidden-size", "64", "--num-layers", "2", "--vocab-size", "300", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"transformers generate", "zoo none", "zoo medusa", "zoo lookahead", "zoo eagle"}
    assert all(row["tok_s"] > 0 for row in rows.values())
    assert all(row["tokens_equal_plain"] for name, row in rows.items() if name.startswith("zoo"))
