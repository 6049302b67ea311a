"""The third-party plugin example in examples/zoo-no-repeat-ngram, installed as a user would.

The example is pip-installed once into a temporary target folder and put on
PYTHONPATH of `python -m zoo.run` / `python -m zoo.plugins` subprocesses, so it
is found through its `zoo.plugins` entry point like any other distribution.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zoo import SamplingParams
from zoo.request import Request

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "zoo-no-repeat-ngram"
PROMPT = "Hello"
MAX_NEW = 40


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the example was pip-installed into (--target)."""
    base = tmp_path_factory.mktemp("example_plugin")
    source, target = base / "src", base / "site"
    # Build from a copy so pip's in-tree build leaves no build/ or *.egg-info in the repository.
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-input", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / "zoo_no_repeat_ngram.py").exists()
    return target


def run_module(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("ZOO_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(installed), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def generate(installed: Path, cwd: Path, *overrides: str) -> dict:
    result = run_module(installed, cwd, "zoo.run", f"prompt={PROMPT}", "output.format=jsonl",
                        f"sampling.max_new_tokens={MAX_NEW}", *overrides)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    record = json.loads(lines[0])
    assert record.get("error") is None, record
    return record


def repeated_ngrams(tokens: list[int], n: int) -> set[tuple[int, ...]]:
    seen, repeated = set(), set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        (repeated if gram in seen else seen).add(gram)
    return repeated


def test_processor_option_bans_repeated_bigrams(installed, tmp_path):
    with_plugin = generate(installed, tmp_path, "processor=no_repeat_ngram", "processor.ngram_size=2")
    assert len(with_plugin["token_ids"]) == MAX_NEW
    assert with_plugin["finish_reason"] == "length"
    full = with_plugin["prompt_token_ids"] + with_plugin["token_ids"]
    assert repeated_ngrams(full, 2) == set(), full

    # Same install, processor left at its default (none): the random-init model loops, so the
    # plugin is what made the difference, and it is inert unless selected.
    without = generate(installed, tmp_path)
    full_without = without["prompt_token_ids"] + without["token_ids"]
    assert repeated_ngrams(full_without, 2), full_without
    assert without["token_ids"] != with_plugin["token_ids"]


def test_bad_ngram_size_is_a_config_error(installed, tmp_path):
    result = run_module(installed, tmp_path, "zoo.run", f"prompt={PROMPT}", "processor=no_repeat_ngram",
                        "processor.ngram_size=0")
    assert result.returncode == 2
    assert "processor.ngram_size=0" in result.stderr


def test_plugin_is_listed_with_its_distribution(installed, tmp_path):
    result = run_module(installed, tmp_path, "zoo.plugins")
    assert result.returncode == 0, result.stderr
    blocks = {block.splitlines()[0].split(":")[0]: block for block in _split_blocks(result.stdout)}
    assert "no_repeat_ngram" in blocks, result.stdout
    block = blocks["no_repeat_ngram"]
    assert "module: zoo_no_repeat_ngram" in block
    assert "from: distribution zoo-no-repeat-ngram 0.1.0" in block
    assert "zoo_logits_process" in block and "zoo_config_register" in block


def _split_blocks(text: str) -> list[str]:
    """`python -m zoo.plugins` prints a name line, then indented detail lines, per plugin."""
    blocks: list[str] = []
    for line in text.splitlines():
        if line and not line.startswith(" "):
            blocks.append(line)
        elif blocks:
            blocks[-1] += "\n" + line
    return blocks


# ---------------------------------------------------------------------------- parity with transformers


@pytest.fixture(scope="module")
def plugin_module(installed):
    """The installed copy of the plugin module, imported in this process."""
    spec = importlib.util.spec_from_file_location("zoo_no_repeat_ngram", installed / "zoo_no_repeat_ngram.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_engine(ngram_size: int, name: str = "no_repeat_ngram"):
    from omegaconf import OmegaConf

    return SimpleNamespace(config=OmegaConf.create({"processor": {"name": name, "ngram_size": ngram_size}}))


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_same_tokens_banned_as_transformers(plugin_module, ngram_size):
    from transformers import NoRepeatNGramLogitsProcessor

    reference = NoRepeatNGramLogitsProcessor(ngram_size)
    engine = fake_engine(ngram_size)
    vocab, rng = 6, random.Random(ngram_size)
    torch.manual_seed(ngram_size)
    for trial in range(4):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        request = Request(trial, prompt, SamplingParams())
        # Grow the sequence token by token, as decoding does, so the plugin's incremental index is exercised.
        for _ in range(20):
            tokens = request.token_ids
            scores = torch.randn(2, vocab)  # a batch of two rows for the same request
            expected = reference(torch.tensor([tokens, tokens]), scores.clone())
            actual = scores.clone()
            plugin_module.zoo_logits_process(logits=actual, requests=[request, request], histories=[tokens, tokens],
                                             engine=engine)
            assert torch.equal(torch.isinf(actual), torch.isinf(expected)), (ngram_size, tokens)
            assert torch.equal(actual[~torch.isinf(actual)], scores[~torch.isinf(actual)])
            request.output_token_ids.append(rng.randrange(vocab))


def test_inactive_unless_selected(plugin_module):
    """The module's scope keeps it out of runs that do not choose processor=no_repeat_ngram."""
    from omegaconf import OmegaConf

    from zoo.plugins import load_plugins, plan_plugins

    def status(processor: str):
        pm = load_plugins(extra=[plugin_module])
        config = OmegaConf.create({"processor": {"name": processor}})
        return {row.name: row for row in plan_plugins(pm, config, "LlamaForCausalLM")}["zoo_no_repeat_ngram"]

    off, on = status("none"), status("no_repeat_ngram")
    assert not off.active and "needs processor=no_repeat_ngram; processor=none is chosen" in off.reason
    assert on.active and "processor=no_repeat_ngram is chosen" in on.reason
