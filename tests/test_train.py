"""zoo.pretrain and zoo.train: a target made from the standard library, heads trained on it, read back.

The target is checked against transformers (same greedy tokens, same tokenizer ids); trained heads must
give tokens identical to plain decoding with a mean accepted length well above 1; bad input is one line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo import LLM, SamplingParams, ZooError
from zoo.config import compose_config

DEFAULT_MODEL = Path(zoo.__file__).parent / "default_model"
HELD_OUT = ["def main():\n", "import os\n", "class Parser:\n    def __init__(self", "    return self."]
PARAMS = SamplingParams(max_new_tokens=48, ignore_eos=True)


def compose(name: str, overrides: list[str]):
    return compose_config(overrides, name)


def python_module(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """A target trained here in seconds: too little to write well, enough to check the checkpoint format."""
    from zoo.pretrain import pretrain

    folder = tmp_path_factory.mktemp("target") / "model"
    cfg = compose("pretrain", [f"out={folder}", "device=cpu", "max_corpus_chars=1000000", "target_size.steps=40",
                               "target_size.vocab_size=512", "target_size.hidden_size=64",
                               "target_size.intermediate_size=128", "target_size.num_hidden_layers=2",
                               "target_size.seq_len=64", "save_dtype=float32"])
    pretrain(cfg)
    return folder


def test_pretrained_target_is_an_hf_checkpoint_that_transformers_reads_alike(small_target):
    import transformers

    log = json.loads((small_target / "pretrain_log.json").read_text())
    assert log["steps"] == 40 and log["log"][-1]["loss"] < log["log"][0]["loss"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(small_target, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(small_target)
    llm = LLM(str(small_target))
    for text in HELD_OUT:
        ids = tokenizer(text).input_ids
        assert ids == llm.tokenizer.encode(text)
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert llm.generate([text], SamplingParams(max_new_tokens=16))[0].token_ids == expected[:16]


def test_the_shipped_default_writes_code_and_drafts_with_its_heads(tmp_path):
    proc = python_module("zoo.run", "prompt=def main():", "sampling.max_new_tokens=40", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "standard library" in proc.stderr
    text = proc.stdout
    assert re.search(r"\n {4}\S", text), text  # an indented block, as Python code has
    for method in ("eagle", "medusa"):
        proc = python_module("zoo.run", f"decoding={method}", "prompt=def main():", "sampling.max_new_tokens=40",
                             cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "checkpoint's own heads" in proc.stderr
        accepted = float(re.search(r"mean accepted length ([\d.]+)", proc.stderr).group(1))
        assert accepted > 1.5, proc.stderr


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_zoo_train_round_trip(tmp_path, method):
    """Heads trained by the command, then loaded by decoding.heads on held-out prompts."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "def ", "import ", "class ", "    if ", "    for ", "        return ", "from ", "    def __init__(self",
        "# ", "try:\n    ", "with open(", "    raise ", "while ", "x = ", "self.", "print(",
    ] * 2))
    out = tmp_path / "heads"
    proc = python_module("zoo.train", f"decoding={method}", f"train.out={out}", f"train.prompts={prompts}",
                         "train.steps=50", "train.max_new_tokens=64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "held-out" in proc.stderr and "tokens identical to plain decoding: yes" in proc.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 50 and log["held_out"]["tokens_identical_to_plain"]
    assert (out / "loss.png").stat().st_size > 1000
    plain = LLM().generate(HELD_OUT, PARAMS)
    llm = LLM(decoding=method, overrides=[f"decoding.heads={out}"])
    drafted = llm.generate(HELD_OUT, PARAMS)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    stats = llm.engine.stats
    assert stats.generated_tokens / stats.token_steps > 1.5


def test_ctrl_c_saves_the_heads_trained_so_far(tmp_path, monkeypatch):
    import zoo.train as train_module

    real = train_module.method_trainer

    def interrupted_after_five(cfg, llm):
        trainer = real(cfg, llm)
        loss, calls = trainer.loss, []

        def loss_or_interrupt(tokens, features):
            calls.append(1)
            if len(calls) > 5:
                raise KeyboardInterrupt
            return loss(tokens, features)

        trainer.loss = loss_or_interrupt
        return trainer

    monkeypatch.setattr(train_module, "method_trainer", interrupted_after_five)
    out = tmp_path / "heads"
    cfg = compose("train", ["decoding=medusa", f"train.out={out}", "train.num_prompts=8", "train.steps=50",
                            "train.max_new_tokens=16"])
    report = train_module.train(cfg)
    assert report["interrupted"] and report["steps"] == 5
    assert json.loads((out / "train_log.json").read_text())["steps"] == 5
    outputs = LLM(decoding="medusa", overrides=[f"decoding.heads={out}"]).generate(HELD_OUT[:1], PARAMS)
    assert outputs[0].token_ids == LLM().generate(HELD_OUT[:1], PARAMS)[0].token_ids


@pytest.mark.parametrize("case, message", [
    ("missing_prompts", "cannot read train.prompts="),
    ("empty_prompts", "holds no prompts"),
    ("bad_model", "does not exist"),
    ("not_heads", "is not a heads folder"),
    ("no_method", "choose the heads to train"),
    ("no_weights", "decoding=lookahead has no weights to train"),
    ("no_out", "set train.out=DIR"),
])
def test_bad_train_input_is_one_line_and_exit_2(tmp_path, case, message, forked):
    out = tmp_path / "heads"
    args = {"missing_prompts": ["decoding=medusa", f"train.out={out}", f"train.prompts={tmp_path / 'none.jsonl'}"],
            "empty_prompts": ["decoding=medusa", f"train.out={out}", f"train.prompts={tmp_path / 'empty.jsonl'}"],
            "bad_model": ["decoding=eagle", f"train.out={out}", f"model.path={tmp_path / 'nomodel'}"],
            "not_heads": ["decoding=eagle", f"train.out={tmp_path}"],
            "no_method": [f"train.out={out}"],
            "no_weights": ["decoding=lookahead", f"train.out={out}"],
            "no_out": ["decoding=medusa"]}[case]
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "notes.txt").write_text("not heads")
    if case in ("missing_prompts", "no_method"):  # the same check in-process, without a subprocess
        from zoo.train import train

        with pytest.raises(ZooError, match=re.escape(message)):
            train(compose("train", args))
        return
    proc = forked.run("zoo.train", *args, "train.steps=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1] and "Traceback" not in proc.stderr, proc.stderr
