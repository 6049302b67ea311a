"""``python -m zoo.run`` as people use it, through the real CLI in a subprocess.

Settings checked before work starts (one line, exit 2, no traceback); records
written as requests finish; Ctrl-C and SIGTERM leave every finished record on
disk (exit 130, 143) and ``input.resume`` continues without repeating any;
exit 3 when a request failed; control characters escaped in text output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from zoo.run import printable

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def zoo_run(*args, cwd, timeout=180):
    return subprocess.run([sys.executable, "-m", "zoo.run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=ENV)


def assert_one_line(proc, message):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: {message}"], lines
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("runtime.block_size=0", "runtime.block_size=0: must be an integer in [1, 4096]"),
    ("runtime.block_size=-16", "runtime.block_size=-16: must be an integer in [1, 4096]"),
    ("runtime.max_num_seqs=0", "runtime.max_num_seqs=0: must be an integer >= 1"),
    ("runtime.max_num_seqs=-1", "runtime.max_num_seqs=-1: must be an integer >= 1"),
    ("runtime.admission_interval=0", "runtime.admission_interval=0: must be an integer >= 1"),
    ("runtime.prompt_graph_tokens=-1", "runtime.prompt_graph_tokens=-1: must be an integer >= 0"),
    ("runtime.mixed_graph_tokens=-5", "runtime.mixed_graph_tokens=-5: must be an integer >= 0"),
    ("runtime.max_num_batched_tokens=0", "runtime.max_num_batched_tokens=0: must be an integer >= 1"),
    ("runtime.gpu_memory_utilization=1.5", "runtime.gpu_memory_utilization=1.5: must be a number in [0.01, 1.0]"),
    ("runtime.seed=abc", "runtime.seed='abc': must be an integer >= 0"),
    ("runtime.enable_prefix_caching=maybe", "runtime.enable_prefix_caching='maybe': must be true or false"),
    ("runtime.cpu_keep_freed_memory=maybe", "runtime.cpu_keep_freed_memory='maybe': must be true or false"),
    ("runtime.attention_backend=flash", "runtime.attention_backend='flash': must be one of auto, sdpa, triton"),
    ("runtime.device=gpu", "runtime.device='gpu': must be auto, cpu, cuda or cuda:N"),
    ("runtime.dtype=float8", "runtime.dtype='float8': must be one of auto, float32, float16, bfloat16"),
    ("runtime.max_model_len=1", "runtime.max_model_len=1: must be an integer >= 2 or null"),
    ("+runtime.nosuch=1", "runtime.nosuch: no such setting"),
    ("+runtime.max_num_seq=4", "runtime.max_num_seq: no such setting (did you mean runtime.max_num_seqs?)"),
    ("+sampling.temprature=0.5", "sampling.temprature: no such setting (did you mean sampling.temperature?)"),
    ("+output.fil=x", "output.fil: no such setting (did you mean output.file?)"),
    ("+promt=hi", "promt: no such setting (did you mean prompt?)"),
    ("output.format=xml", "output.format='xml': must be one of text, jsonl"),
    ("output.progress=sometimes", "output.progress='sometimes': must be one of auto, on, off"),
    ("output.stream=true", "output.stream=true writes JSONL token events: it needs output.format=jsonl"),
    ("plugins.disable=[lookahed]", "plugins.disable names 'lookahed', which is no installed plugin (did you mean "
                                   "lookahead?)"),
    ("input.file=/no/such/file.jsonl", "cannot read input.file=/no/such/file.jsonl: No such file or directory"),
    ("input.resume=true", "input.resume=true needs output.file (the records to continue from)"),
    ("decoding=nosuch", "decoding=nosuch: no such option (available: eagle, lookahead, medusa, none)"),
])
def test_a_bad_setting_is_one_line_before_anything_loads(override, message, tmp_path, forked):
    proc = forked.run("zoo.run", override, cwd=tmp_path, env=ENV)
    assert_one_line(proc, message)
    assert "loading weights" not in proc.stderr  # nothing loaded


def test_a_forked_command_answers_as_a_fresh_process_does(tmp_path, forked):
    """The ``forked`` fixture, which runs the bad-setting tests above, gives a fresh interpreter's status and output."""
    fresh = zoo_run("runtime.block_size=0", cwd=tmp_path)
    fork = forked.run("zoo.run", "runtime.block_size=0", cwd=tmp_path, env=ENV)
    assert (fork.returncode, fork.stdout, fork.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    crash = forked.run("zoo.no_such_module", cwd=tmp_path)  # an uncaught exception: its traceback and status 1
    assert crash.returncode == 1 and "Traceback" in crash.stderr
    assert "No module named zoo.no_such_module" in crash.stderr


def test_a_bad_memory_share_in_the_environment_is_one_line(tmp_path):
    """$ZOO_GPU_MEMORY_UTILIZATION is runtime.gpu_memory_utilization's default, checked like the setting."""
    proc = subprocess.run([sys.executable, "-m", "zoo.run"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=180, env={**ENV, "ZOO_GPU_MEMORY_UTILIZATION": "most"})
    assert_one_line(proc, "runtime.gpu_memory_utilization='most': must be a number in [0.01, 1.0]")


def test_cuda_on_a_machine_without_it_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = zoo_run("runtime.device=cuda", cwd=tmp_path)
    assert proc.returncode == 2 and "runtime.device=cuda: this machine has no CUDA device" in proc.stderr


def write_requests(path, count, max_new_tokens=24, extra_lines=()):
    lines = [json.dumps({"prompt": f"def f{i}(", "max_new_tokens": max_new_tokens}) for i in range(count)]
    path.write_text("\n".join(lines + list(extra_lines)) + "\n")
    return len(lines) + len(extra_lines)


def test_records_name_their_line_and_a_bad_line_fails_alone(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "def f(", "max_new_tokens": 4}), "",
                               "{not json", json.dumps({"prompt": "x", "prompt_ids": [1, 2]}),
                               json.dumps({"id": "mine", "prompt": "import os", "max_new_tokens": 4})]) + "\n")
    proc = zoo_run(f"input.file={path}", "output.format=jsonl", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # some requests failed
    records = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(records) == {1, 3, 4, "mine"}  # line numbers, 1-based; the blank line 2 is no request
    assert records[3]["error"].startswith(f"line 3 of {path} is not valid JSON")
    assert records[4]["error"] == f"line 4 of {path} has both prompt and prompt_ids; give one"
    assert len(records[1]["token_ids"]) == len(records["mine"]["token_ids"]) == 4
    assert "failed requests: 2 of 4" in proc.stderr


@pytest.mark.parametrize("signame, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stopped_run_keeps_its_records_and_resumes_each_once(tmp_path, signame, status):
    total = write_requests(tmp_path / "in.jsonl", 16, max_new_tokens=80, extra_lines=["{bad"])
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "zoo.run", f"input.file={tmp_path / 'in.jsonl'}", f"output.file={out}",
            "output.format=jsonl", "runtime.max_num_seqs=1"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV)
    deadline = time.time() + 120
    while (not out.exists() or len(out.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signame))
    stderr = proc.communicate(timeout=60)[1]
    assert proc.returncode == status and "Traceback" not in stderr
    written = len(out.read_text().splitlines())
    assert 3 <= written < total
    assert stderr.strip().splitlines()[-1] == (f"stopped: {written} of {total} requests done, their records written "
                                               f"to {out}; input.resume=true continues")
    resumed = subprocess.run(args + ["input.resume=true"], capture_output=True, text=True, cwd=tmp_path, env=ENV,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr  # the failed line was written before the stop
    assert f"resuming: {written} of {total} requests are already in {out}" in resumed.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(1, total + 1))  # every record exactly once


def test_streamed_token_events_concatenate_to_each_record(tmp_path):
    """output.stream=true: each request's token lines come before its record, in order, and their tokens and
    text concatenate to the record's; a stop string is never shown before it is cut; resume skips only
    requests with a record."""
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": f"def f{i}(", "max_new_tokens": 6 + 3 * i}) for i in range(4)]
    lines[2] = json.dumps({"prompt": "def f2(", "max_new_tokens": 12, "logprobs": 1})
    lines.append(json.dumps({"prompt": "import os", "max_new_tokens": 12, "stop": ["e"]}))
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = zoo_run(f"input.file={path}", f"output.file={out}", "output.format=jsonl", "output.stream=true",
                   "runtime.max_num_seqs=3", cwd=tmp_path)  # 3 at a time: a request joins as another ends
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    records = {r["id"]: r for r in rows if "event" not in r}
    assert sorted(records) == [1, 2, 3, 4, 5]
    first_record_row = {r["id"]: i for i, r in reversed(list(enumerate(rows))) if "event" not in r}
    for rid, record in records.items():
        events = [(i, r) for i, r in enumerate(rows) if r.get("event") == "token" and r["id"] == rid]
        assert events and all(i < first_record_row[rid] for i, _ in events)
        assert [t for _, e in events for t in e["token_ids"]] == record["token_ids"]
        assert "".join(e["text"] for _, e in events) == record["text"]
        if rid == 3:  # asked for log-probs: each line carries its tokens'
            assert [entry for _, e in events for entry in e["logprobs"]] == record["logprobs"]
        else:
            assert all("logprobs" not in e for _, e in events)
    assert records[5]["finish_reason"] in ("stop", "length") and "e" not in records[5]["text"]
    interleaved = [r["id"] for r in rows if r.get("event") == "token"]
    assert interleaved != sorted(interleaved)  # a batch: requests' events interleave
    # a run stopped after request 1's events but before its record: resume runs it again
    out.write_text("\n".join(json.dumps(r) for r in rows if r["id"] != 1) + "\n"
                   + json.dumps({"id": 1, "event": "token", "token_ids": [5], "text": "x"}) + "\n")
    resumed = zoo_run(f"input.file={path}", f"output.file={out}", "output.format=jsonl", "input.resume=true",
                      cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming: 4 of 5 requests" in resumed.stderr, resumed.stderr


def test_resume_drops_a_record_cut_short(tmp_path):
    write_requests(tmp_path / "in.jsonl", 3, max_new_tokens=4)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 1, "token_ids": [], "text": "", "finish_reason": "length"}) + '\n{"id": 2, "tok')
    proc = zoo_run(f"input.file={tmp_path / 'in.jsonl'}", f"output.file={out}", "output.format=jsonl",
                   "input.resume=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [1, 2, 3]


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path):
    write_requests(tmp_path / "in.jsonl", 3, max_new_tokens=4)
    quiet = zoo_run(f"input.file={tmp_path / 'in.jsonl'}", cwd=tmp_path)  # stderr is a pipe: auto shows none
    shown = zoo_run(f"input.file={tmp_path / 'in.jsonl'}", "output.progress=on", cwd=tmp_path)
    assert "3/3" not in quiet.stderr and "3/3" in shown.stderr and "req" in shown.stderr


def test_text_output_escapes_control_characters():
    assert printable("a\x1b[31mred\x07\nnext\tcol\x00") == "a\\x1b[31mred\\x07\nnext\tcol\\x00"
    assert printable("plain text") == "plain text"


def test_text_output_of_the_cli_holds_no_escape_codes(tmp_path):
    """Random GPT-2 weights print arbitrary bytes; none reaches the terminal raw."""
    proc = zoo_run("model=gpt2", "prompt=Hello", "sampling.max_new_tokens=64", "sampling.temperature=1.0",
                   "sampling.seed=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not any(c != "\n" and c != "\t" and ord(c) < 32 for c in proc.stdout)


def test_an_override_hydra_refuses_is_one_line(tmp_path):
    assert_one_line(zoo_run("sampling.tempratur=1", cwd=tmp_path),
                    "sampling.tempratur: no such setting (did you mean sampling.temperature?); a new key needs "
                    "+sampling.tempratur=...")
    proc = zoo_run("sampling.logit_bias={42: 100.0}", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "+sampling.logit_bias" in proc.stderr


def test_a_newline_stop_string_through_bash_quoting(tmp_path):
    """`sampling.stop=$'["\\n"]'` (bash turns \\n into a newline; Hydra keeps a typed backslash-n as two characters)."""
    proc = zoo_run("prompt=def", "sampling.max_new_tokens=40", 'sampling.stop=["\n"]', "output.format=jsonl",
                   cwd=tmp_path)
    record = json.loads(proc.stdout)
    assert record["finish_reason"] == "stop" and "\n" not in record["text"]


def test_a_sweep_labels_its_jobs_goes_on_past_a_failure_and_writes_a_table(tmp_path):
    proc = zoo_run("-m", "sampling.temperature=-1,0", "prompt=def", "sampling.max_new_tokens=4",
                   f"output.sweep_table={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 3  # job 0 did not succeed
    assert "=== job 0: sampling.temperature=-1" in proc.stdout and "=== job 1: sampling.temperature=0" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("[1] ")  # job 1 ran after job 0 failed
    assert "sweep: job(s) 0 did not succeed" in proc.stderr
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert rows[0] == "job,overrides,status,requests,failed,generated_tokens,decode_tok_s"
    assert rows[1].startswith("0,") and ",2," in rows[1] and rows[2].startswith("1,") and ",0,1,0,4," in rows[2]
    assert (tmp_path / "sweep.md").read_text().startswith("| job | overrides |")
    assert not (tmp_path / "multirun.yaml").exists() and not (tmp_path / "multirun").exists()


def test_a_model_option_for_another_architecture_is_one_line(checkpoints, tmp_path):
    llama = checkpoints["llama"][0]
    assert_one_line(zoo_run("model=gpt2", f"model.path={llama}", cwd=tmp_path),
                    f"model=gpt2 is for checkpoints of plugin gpt, but {llama} holds LlamaForCausalLM (plugin llama); "
                    "leave out model= (model=llama takes any architecture) or choose the option for it")
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")  # no tokenizer.json there
    proc = zoo_run(f"model.path={checkpoints['gpt2'][0]}", f"input.file={tmp_path / 'in.jsonl'}",
                   "sampling.max_new_tokens=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # the default option takes the checkpoint's architecture


@pytest.mark.parametrize("args, fragment", [
    (["decoding=eagle", "plugins.disable=[eagle]"], "decoding=eagle: no plugin that takes part registers it"),
    (["model=gpt2", "plugins.disable=[gpt]"], "unknown architecture ['GPT2LMHeadModel']"),
])
def test_disabling_a_plugin_the_options_need_says_so(args, fragment, tmp_path):
    proc = zoo_run(*args, cwd=tmp_path)
    disabled = args[1].split("[")[1].rstrip("]")
    assert proc.returncode == 2 and fragment in proc.stderr
    assert f"left out: {disabled} (disabled (plugins.disable))" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_lists_every_checked_setting_with_its_value(tmp_path):
    from zoo.settings import RUN, RUNTIME

    proc = zoo_run("--help", "runtime.max_num_seqs=8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for key in [f"runtime.{k}" for k in RUNTIME] + list(RUN):
        assert f"  {key} " in proc.stdout, key
    assert "runtime.max_num_seqs            = 8           an integer >= 1" in proc.stdout


def test_n_samples_in_a_record_and_in_streamed_events(tmp_path):
    proc = zoo_run("prompt=def f(", "sampling.n=3", "sampling.temperature=0.8", "sampling.seed=4",
                   "sampling.max_new_tokens=5", "sampling.ignore_eos=true", "output.format=jsonl",
                   "output.stream=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    record = rows[-1]
    assert "event" not in record and [s["index"] for s in record["samples"]] == [0, 1, 2]
    assert record["token_ids"] == record["samples"][0]["token_ids"]
    for sample in record["samples"]:
        events = [r for r in rows[:-1] if r["sample"] == sample["index"]]
        assert [t for e in events for t in e["token_ids"]] == sample["token_ids"] and len(sample["token_ids"]) == 5
        assert "".join(e["text"] for e in events) == sample["text"]
