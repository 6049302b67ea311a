"""Plugin discovery, hook validation, allow/deny lists, listing, config groups."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import zoo
from zoo import LLM, SamplingParams, ZooError, hookimpl
from zoo.config import compose_config
from zoo.plugins import describe_plugins, load_plugins


def fake_distribution(root, dist_name, plugin_name, module_name, source):
    """A minimal installed distribution: a module plus dist-info with a zoo.plugins entry point."""
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[zoo.plugins]\n{plugin_name} = {module_name}\n")


def run_module(module, *args, pythonpath=None, env=None, cwd=None):
    environ = {**os.environ, **(env or {})}
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join([str(pythonpath), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=environ, cwd=cwd, timeout=120)


def test_builtin_plugins_come_from_entry_points():
    pm = load_plugins()
    rows = {row["name"]: row for row in describe_plugins(pm)}
    assert rows["llama"]["module"] == "zoo_plugins.llama"
    assert rows["gpt"]["module"] == "zoo_plugins.gpt"
    assert "zoo-runtime" in rows["llama"]["distribution"]
    assert "zoo_model_architectures" in rows["gpt"]["hooks"] and "zoo_weights_convert" in rows["gpt"]["hooks"]


def test_python_m_zoo_plugins_lists_everything(tmp_path):
    proc = run_module("zoo.plugins", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for expected in ("llama", "gpt", "zoo_plugins.llama", "zoo-runtime", "zoo_weights_convert"):
        assert expected in proc.stdout


def test_allow_list_and_disable(monkeypatch):
    monkeypatch.setenv("ZOO_PLUGINS", "llama")
    assert [r["name"] for r in describe_plugins(load_plugins())] == ["llama"]
    monkeypatch.delenv("ZOO_PLUGINS")
    assert "gpt" not in [r["name"] for r in describe_plugins(load_plugins(disable=["gpt"]))]


def test_disabling_a_model_plugin_through_config():
    with pytest.raises(ZooError, match="unknown architecture.*GPT2LMHeadModel"):
        LLM(model="gpt2", overrides=["plugins.disable=[gpt]"])


def test_broken_plugin_names_itself_and_its_distribution(tmp_path):
    fake_distribution(tmp_path, "acme-broken", "acme", "acme_zoo_plugin", "raise ImportError('needs libfoo')\n")
    proc = run_module("zoo.plugins", pythonpath=tmp_path, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'acme'" in proc.stderr and "acme-broken 1.2.3" in proc.stderr and "needs libfoo" in proc.stderr
    proc = run_module("zoo.run", pythonpath=tmp_path, cwd=tmp_path)
    assert proc.returncode == 2 and "acme-broken" in proc.stderr and "Traceback" not in proc.stderr


def test_misspelt_hook_is_rejected(tmp_path):
    fake_distribution(tmp_path, "acme-typo", "typo", "acme_typo", """
        from zoo import hookimpl

        @hookimpl
        def zoo_model_architecture():  # missing the final s
            return {}
    """)
    proc = run_module("zoo.plugins", pythonpath=tmp_path, cwd=tmp_path)
    assert proc.returncode == 2 and "'typo'" in proc.stderr and "zoo_model_architecture" in proc.stderr


def test_hook_with_unknown_argument_is_rejected():
    class Bad:
        @hookimpl
        def zoo_request_validate(self, request, nonsense):
            return None

    with pytest.raises(ZooError, match="(?s)invalid.*nonsense"):
        load_plugins(extra=[Bad()])


def test_third_party_architecture_plugin(tmp_path):
    """A plugin from an installed distribution can add a whole architecture."""
    fake_distribution(tmp_path, "acme-tiny", "tiny", "acme_tiny", """
        from zoo import ModelDescription, hookimpl

        def describe(hf):
            return ModelDescription(architecture="TinyForCausalLM", vocab_size=hf["vocab_size"], hidden_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
                                    norm="layer", activation="relu", gated_mlp=False, position="learned")

        @hookimpl
        def zoo_model_architectures():
            return {"TinyForCausalLM": describe}

        @hookimpl
        def zoo_config_register(config_store):
            config_store.store(group="model", name="tiny",
                               node={"name": "tiny", "path": None,
                                     "embedded": {"architectures": ["TinyForCausalLM"], "seed": 3}})
    """)
    proc = run_module("zoo.run", "model=tiny", "prompt=hi", "sampling.max_new_tokens=3", "output.format=jsonl",
                      pythonpath=tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "TinyForCausalLM" in proc.stderr and '"finish_reason": "length"' in proc.stdout


def test_request_fields_hook_admits_plugin_fields():
    class Adapters:
        name = "adapters"

        @hookimpl
        def zoo_request_fields(self):
            return ["adapter"]

        @hookimpl
        def zoo_request_admit(self, request):
            request.plugin_state["adapters"] = request.extras["adapter"]

    llm = LLM(plugins=[Adapters()])
    out = llm.generate([{"prompt": "a", "adapter": "x"}, {"prompt": "b", "adaptor": "x"}],
                       SamplingParams(max_new_tokens=2))
    assert out[0].finish_reason == "length"
    assert out[1].finish_reason == "error" and "unknown request field(s): adaptor (plugins read: adapter" in out[1].error


def test_request_validate_hook_rejects_one_request():
    class NoSevens:
        name = "no_sevens"

        @hookimpl
        def zoo_request_validate(self, request):
            return "sevens are not allowed" if 7 in request.prompt_token_ids else None

    llm = LLM(plugins=[NoSevens()])
    outs = llm.generate([[1, 7, 3], [1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert outs[0].finish_reason == "error" and outs[0].error == "sevens are not allowed"
    assert outs[1].finish_reason == "length"


def test_declared_buffers_are_filled_each_step():
    """A plugin adds a per-token buffer at engine start and fills it; the forward context shows the step's view."""
    import torch

    from zoo.step import BufferSpec

    seen = []

    class TokenParity:
        name = "token_parity"

        @hookimpl
        def zoo_engine_start(self, setup):
            setup.add_buffer(BufferSpec("token_parity", (setup.limits.max_num_tokens,)))

        @hookimpl
        def zoo_step_prepare(self, batch, buffers):
            self.profiling = batch.scheduled[0].request.request_id < 0  # the CUDA memory-profile step
            ids = [t for entry in batch.scheduled
                   for t in entry.request.token_ids[entry.start:entry.start + entry.num_tokens]]
            buffers["token_parity"].copy_(torch.tensor(ids) % 2)

        @hookimpl
        def zoo_embed_modify(self, hidden, context):
            if not self.profiling:
                seen.append(context.buffers["token_parity"].tolist())

    # Eager: under CUDA graphs the embed hook's Python runs at capture only, and the graph reads the buffer.
    llm = LLM(plugins=[TokenParity()], enforce_eager=True)
    llm.generate([[2, 3, 5]], SamplingParams(max_new_tokens=2))
    assert seen[0] == [0, 1, 1] and len(seen) == 2 and len(seen[1]) == 1


def test_config_groups_and_experiment():
    cfg = compose_config(["model=gpt2", "experiment=sample_creative"])
    assert cfg.model.name == "gpt2" and cfg.decoding.name == "none" and cfg.runtime.block_size == 16
    assert cfg.sampling.temperature == 0.8 and cfg.sampling.seed == 1234
    with pytest.raises(ZooError, match="runtime.nonexistent: no such setting"):
        compose_config(["runtime.nonexistent=1"])


def test_full_size_dummy_step_fits_the_limits():
    """The step the GPU memory profile runs: more tokens than one sequence may hold."""
    # GPT-2's learned positions fail loudly if a dummy sequence runs past max_model_len
    from test_speculative import with_method

    class TwoDrafts(zoo.DecodingMethod):
        name, max_draft_tokens = "two_drafts", 2

        def propose(self, requests):
            return {}

    llm = LLM(model="gpt2", max_model_len=40, max_num_batched_tokens=100, block_size=8,
              plugins=[with_method("two_drafts", TwoDrafts())], overrides=["decoding.name=two_drafts"])
    runner = llm.engine.runner
    assert runner.limits.max_num_tokens == 100 + 32 * 2
    runner.run_full_step()  # 100 + 32*2 tokens over sequences of at most 40 tokens
    runner.kv.allocate(llm.engine.num_blocks)
    out = llm.generate(["again"], SamplingParams(max_new_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_position_hook_reaches_the_model(checkpoints):
    """A plugin shifting every position by 3 gives transformers' logits for position_ids + 3 (GPT-2)."""
    import torch

    from conftest import prompt_set
    from test_parity import LogitsRecorder

    folder, model = checkpoints["gpt2"]

    class Shift:
        name = "shift_positions"

        @hookimpl
        def zoo_step_positions(self, indices):
            return [[i + 3 for i in indices]]

    recorder = LogitsRecorder()
    prompt = prompt_set()[1]
    # max_model_len 200: the CUDA memory-profile step's dummy prompts fill it, and shifted by 3 they
    # must still fit GPT-2's 256 learned positions.
    LLM(str(folder), model="gpt2", plugins=[Shift(), recorder], max_model_len=200).generate(
        [prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        shifted = model(ids, position_ids=torch.arange(len(prompt))[None] + 3).logits[0, -1]
        plain = model(ids).logits[0, -1]
    torch.testing.assert_close(recorder.rows[0][0], shifted, atol=1e-4, rtol=0)
    assert (recorder.rows[0][0] - plain).abs().max() > 1e-2  # the shift really changed something


def test_token_hook_can_stop_a_request():
    seen = []

    class StopAtThird:
        name = "stop_at_third"

        @hookimpl
        def zoo_token_generated(self, request, token_id):
            seen.append(token_id)
            return len(request.output_token_ids) == 3

    out = LLM(plugins=[StopAtThird()]).generate(["abc"], SamplingParams(max_new_tokens=10))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 3 and seen == out.token_ids
