"""Every bad input: one clear message, no traceback; bad requests never harm the rest of the batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import prompt_set
from zoo import LLM, SamplingParams, ZooError


def zoo_run(*args, cwd, env=None):
    proc = subprocess.run([sys.executable, "-m", "zoo.run", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# ------------------------------------------------------------------ fatal: whole run

def _broken_checkpoints(root, good):
    cases = {}
    missing = root / "missing"
    cases["missing"] = (missing, "does not exist")
    no_config = root / "no_config"
    no_config.mkdir()
    cases["no_config"] = (no_config, "model config not found")
    bad_json = root / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    cases["bad_json"] = (bad_json, "is not valid JSON")
    unknown = root / "unknown_arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    cases["unknown_arch"] = (unknown, "unknown architecture ['FooForCausalLM']")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((good / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-safetensors")
    cases["corrupt"] = (corrupt, "corrupt or unreadable")
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    cases["no_weights"] = (no_weights, "no *.safetensors weights")
    wrong_shape = root / "wrong_shape"
    wrong_shape.mkdir()
    config = json.loads((good / "config.json").read_text())
    config["hidden_size"] = 32
    (wrong_shape / "config.json").write_text(json.dumps(config))
    (wrong_shape / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    cases["wrong_shape"] = (wrong_shape, "has shape")
    return cases


@pytest.fixture(scope="module")
def broken(checkpoints, tmp_path_factory):
    return _broken_checkpoints(tmp_path_factory.mktemp("broken"), checkpoints["llama"][0])


@pytest.mark.parametrize("case", ["missing", "no_config", "bad_json", "unknown_arch", "corrupt", "no_weights",
                                  "wrong_shape"])
def test_broken_checkpoint_api(broken, case):
    path, message = broken[case]
    with pytest.raises(ZooError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        LLM(str(path))


def test_broken_checkpoint_cli(broken, tmp_path):
    path, message = broken["corrupt"]
    proc = zoo_run(f"model.path={path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and message in proc.stderr
    path, message = broken["unknown_arch"]
    proc = zoo_run(f"model.path={path}", cwd=tmp_path)
    assert proc.returncode == 2 and "FooForCausalLM" in proc.stderr and "LlamaForCausalLM" in proc.stderr


def test_hub_id_offline_without_cache(tmp_path):
    proc = zoo_run("model.path=nobody/no-such-model", cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2 and "nobody/no-such-model" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("sampling.tempratur=1", "sampling.tempratur: no such setting (did you mean sampling.temperature?)"),
    ("+sampling.tempratur=1", "sampling.tempratur: no such setting (did you mean sampling.temperature?)"),
    ("runtime.dtype=float8", "runtime.dtype='float8'"),
    ("sampling.temperature=-1", "temperature=-1"),
    ("output.format=xml", "output.format='xml'"),
    ("input.file=/no/such/file.jsonl", "cannot read input.file"),
    ("model=nonexistent", "model=nonexistent: no such option (available: chatglm, glm, gpt2, llama, qwen2_vl)"),
])
def test_bad_config_is_fatal_with_message(override, message, tmp_path, forked):
    proc = forked.run("zoo.run", override, cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode != 0
    assert message in proc.stderr


def test_unknown_plugin_in_allow_list(tmp_path):
    proc = zoo_run(cwd=tmp_path, env={"ZOO_PLUGINS": "llama,gpt,nosuchplugin"})
    assert proc.returncode == 2 and "nosuchplugin" in proc.stderr


# ------------------------------------------------------------------ per request

def test_bad_requests_are_rejected_and_the_rest_complete(checkpoints, tmp_path):
    folder = checkpoints["llama"][0]
    good = prompt_set()[:2]
    records = [
        {"prompt_ids": good[0], "max_new_tokens": 4},
        {"prompt_ids": [1, 2, 300]},  # vocab is 300
        {"prompt_ids": [1] * 256},  # max_position_embeddings is 256
        {"prompt_ids": []},
        {"prompt": "text"},  # the checkpoint has no tokenizer.json
        {"prompt_ids": good[1], "temperature": -0.5},
        {"prompt_ids": good[1], "top_p": 0},
        {"prompt_ids": good[1], "max_new_tokens": 0},
        {"prompt_ids": good[1], "logit_bias": {"999": 1.0}},
        {"prompt_ids": good[1], "sampling": {"bogus": 1}},
        {"prompt_ids": "not a list"},
        {"prompt_ids": good[1], "temprature": 0.5},  # misspelt sampling key
        {"prompt_ids": good[1], "max_new_tokens": 4},
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(4, "{broken json")
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = zoo_run(f"model.path={folder}", f"input.file={path}", "output.format=jsonl", "sampling.ignore_eos=true",
                   cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # some requests failed
    outputs = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda o: o["id"])  # as they finish
    assert [o["id"] for o in outputs] == list(range(1, len(lines) + 1))  # line numbers
    reasons = [o["finish_reason"] for o in outputs]
    assert reasons[0] == reasons[-1] == "length"
    assert len(outputs[0]["token_ids"]) == len(outputs[-1]["token_ids"]) == 4
    assert reasons[1:-1] == ["error"] * (len(lines) - 2)
    errors = [o["error"] for o in outputs[1:-1]]
    expected = ["outside the vocabulary", "the model's limit is 256", "prompt is empty", "line 5",
                "no tokenizer.json", "temperature=-0.5", "top_p=0", "max_new_tokens=0",
                "outside the vocabulary", "unknown sampling key(s): bogus", "prompt_ids must be a list",
                "unknown request field(s): temprature"]
    for error, fragment in zip(errors, expected):
        assert fragment in error, (fragment, error)
    assert f"requests: {len(lines)}  prompt tokens" in proc.stderr  # refused ones too, each counted once
    assert f"failed requests: {len(lines) - 2} of {len(lines)}" in proc.stderr


def test_request_too_big_for_cache_is_rejected(checkpoints):
    llm = LLM(str(checkpoints["llama"][0]), block_size=4, num_kv_blocks=6)
    outs = llm.generate([prompt_set()[0], prompt_set()[1]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error" and "needs 10 KV blocks" in outs[1].error


@pytest.mark.parametrize("prompt", ["def main():", "it's (x) [1, 2]", "a\\b", "ends\\", "q\\'x", "x=1, y=2", "${oops}",
                                    "f'{x}'", ""])
def test_prompt_text_reaches_the_engine_as_typed(prompt):
    """`prompt="def main():"` is plain text to the shell user; Hydra's grammar would choke on the parentheses."""
    from zoo.config import compose_config
    from zoo.config import quote_free_text

    assert compose_config(quote_free_text([f"prompt={prompt}"])).prompt == prompt
