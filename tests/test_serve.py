"""``python -m zoo.serve`` through the real ``openai`` client and raw HTTP, against a server started on 127.0.0.1:
completions and chat, streamed and not, equal to ``zoo.LLM`` for the same settings; an adapter chosen by name;
auth; every bad request; a client that disconnects; a load of concurrent streams; SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
try:  # the openai client's HTTP library (httpx, renamed httpx2 in its 2.x releases)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import TWO_RANKS  # noqa: E402
from zoo import LLM, SamplingParams  # noqa: E402
from zoo.engine_process import free_port  # noqa: E402

KEY = "test-key-123"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded default model with a chat template, its tokenizer adding a BOS to every text as Llama 3's
    does (the template writes its own), and a LoRA adapter for it made with peft."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, processors

    import zoo

    folder = tmp_path_factory.mktemp("served")
    source = Path(zoo.__file__).parent / "default_model"
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(source / name, folder / name)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    bos = "<|endoftext|>"  # the default model's BOS (tokenizer_config.json)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))
    adapter = tmp_path_factory.mktemp("sql")
    lora.save_pretrained(adapter)
    return folder, adapter


class Served:
    def __init__(self, args, cwd):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("ZOO_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "zoo.serve", f"server.port={self.port}", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def model_name(self, key=KEY) -> str:
        models = httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        return models["data"][0]["id"]

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self, key=KEY) -> dict:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    folder, adapter = model_dir
    server = Served([f"model.path={folder}", f"+adapters.sql={adapter}", f"server.api_key={KEY}",
                     "server.max_body_bytes=20000", "server.max_prompt_tokens=200", "runtime.max_num_seqs=96"],
                    cwd=tmp_path_factory.mktemp("cwd"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local(model_dir):
    folder, adapter = model_dir
    return LLM(str(folder), adapters={"sql": str(adapter)}, max_num_seqs=96)


def test_completions_streamed_and_not_equal_the_python_api(served, local):
    client = served.client()
    for settings in (dict(temperature=0.0), dict(temperature=0.8, seed=5, top_p=0.9)):
        reply = client.completions.create(model=served.model_name(), prompt="def main(", max_tokens=12, **settings)
        chunks = list(client.completions.create(model=served.model_name(), prompt="def main(", max_tokens=12,
                                                stream=True, **settings))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        params = {"max_new_tokens": 12, **({"temperature": settings["temperature"]} if settings["temperature"] else
                                           {"temperature": 0.0}), **{k: v for k, v in settings.items()
                                                                     if k in ("seed", "top_p")}}
        expected = local.generate(["def main("], SamplingParams(**params))[0]
        assert reply.choices[0].text == streamed == expected.text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert reply.usage.completion_tokens == len(expected.token_ids) == 12
        assert chunks[-1].choices[0].finish_reason == "length"


def test_a_completion_equals_zoo_run(served, model_dir, tmp_path):
    folder, _ = model_dir
    settings = ["sampling.temperature=0.7", "sampling.seed=9", "sampling.max_new_tokens=10"]
    cli = subprocess.run([sys.executable, "-m", "zoo.run", f"model.path={folder}", "prompt=import os", *settings,
                          "output.format=jsonl"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert cli.returncode == 0, cli.stderr
    record = json.loads(cli.stdout.splitlines()[-1])
    reply = served.client().completions.create(model=served.model_name(), prompt="import os", max_tokens=10,
                                               temperature=0.7, seed=9)
    assert reply.choices[0].text == record["text"]


def test_a_decoding_method_serves_and_reports_accepted_tokens(model_dir, tmp_path):
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "decoding=lookahead"], cwd=tmp_path)
    try:
        reply = server.client().completions.create(model=server.model_name(), prompt="def f(", max_tokens=40,
                                                   temperature=0)
        plain = LLM(str(folder)).generate(["def f("], SamplingParams(max_new_tokens=40))[0].text
        assert reply.choices[0].text == plain  # greedy: exactly plain decoding's tokens
        assert server.metrics()["zoo_tokens_per_request_step"] > 1.0  # drafts were accepted
    finally:
        server.stop()


def test_chat_uses_the_checkpoint_template(served, local, model_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir[0])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print hello"}]
    # the peer's render and tokens: one BOS, the template's (the tokenizer adds none to a rendered chat)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    bos = tokenizer.bos_token_id
    assert ids[0] == bos != ids[1] and tokenizer("print hello")["input_ids"][0] == bos
    expected = local.generate([{"prompt_ids": ids}], SamplingParams(max_new_tokens=10, temperature=0.0))[0].text
    client = served.client()
    reply = client.chat.completions.create(model=served.model_name(), messages=messages, max_tokens=10,
                                           temperature=0)
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=served.model_name(), messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert reply.choices[0].message.content == expected
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    # the chat API's newer name for the length cap
    capped = client.chat.completions.create(model=served.model_name(), messages=messages, max_completion_tokens=4,
                                            temperature=0)
    assert capped.usage.completion_tokens == 4 and expected.startswith(capped.choices[0].message.content)


def test_an_adapter_is_a_model(served, local):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.model_name(), "sql"]
    card = client.models.retrieve("sql")  # OpenAI's retrieve: one entry of the list
    assert card.id == "sql" and card.parent == served.model_name() and card.max_model_len == local.engine.max_model_len
    assert client.models.retrieve(served.model_name()).parent is None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nosuch")
    reply = client.completions.create(model="sql", prompt="SELECT", max_tokens=10, temperature=0)
    expected = local.generate([{"prompt": "SELECT", "adapter": "sql"}], SamplingParams(max_new_tokens=10))[0].text
    base = local.generate(["SELECT"], SamplingParams(max_new_tokens=10))[0].text
    assert reply.choices[0].text == expected != base


def test_n_logprobs_and_penalties_map_onto_sampling(served, local):
    client = served.client()
    reply = client.completions.create(model=served.model_name(), prompt=["import", "class"], max_tokens=5,
                                      temperature=0.9, n=2, seed=11, logprobs=2, frequency_penalty=0.5)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    outs = local.generate(["import", "class"], SamplingParams(max_new_tokens=5, temperature=0.9, n=2, seed=11,
                                                              logprobs=2, frequency_penalty=0.5))
    assert [c.text for c in reply.choices] == [s.text for o in outs for s in o.samples]
    assert len(reply.choices[0].logprobs.tokens) == 5 and len(reply.choices[0].logprobs.top_logprobs[0]) == 2
    # streamed, three samples a prompt (each may end at its own step): each choice's text in its own chunks
    settings = dict(max_tokens=12, temperature=0.9, n=3, seed=4)
    reply = client.completions.create(model=served.model_name(), prompt=["import", "class"], **settings)
    chunks = list(client.completions.create(model=served.model_name(), prompt=["import", "class"], stream=True,
                                            **settings))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(6)]
    assert streamed == [c.text for c in reply.choices]


def test_a_stream_carries_each_chunks_logprobs(served, model_dir):
    """Streamed with logprobs (completions, chat; greedy, and n=2 sampled): each chunk carries its tokens'
    log-probs, which join to those of the same request not streamed."""
    client, name = served.client(), served.model_name()
    for settings in (dict(temperature=0.0), dict(temperature=0.9, seed=7, n=2)):
        reply = client.completions.create(model=name, prompt="def main(", max_tokens=9, logprobs=3, **settings)
        chunks = list(client.completions.create(model=name, prompt="def main(", max_tokens=9, logprobs=3,
                                                stream=True, **settings))
        for choice in reply.choices:
            mine = [c.choices[0].logprobs for c in chunks
                    if c.choices and c.choices[0].index == choice.index and c.choices[0].logprobs is not None]
            assert mine and len(choice.logprobs.tokens) == 9
            for field in ("tokens", "token_logprobs", "top_logprobs"):
                assert sum((getattr(m, field) for m in mine), []) == getattr(choice.logprobs, field)
    messages = [{"role": "user", "content": "write a function"}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=7, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=7, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs is not None
                for entry in c.choices[0].logprobs.content]
    whole = reply.choices[0].logprobs.content
    # the second request takes the chat prompt's full blocks from the prefix cache and computes only the rest:
    # the same tokens, log-probs equal to float32 rounding
    assert len(whole) == 7 and [e.token for e in streamed] == [e.token for e in whole]
    for mine, theirs in zip(streamed, whole):
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t.logprob for t in mine.top_logprobs] == pytest.approx([t.logprob for t in theirs.top_logprobs],
                                                                       abs=1e-4)
    plain = list(client.completions.create(model=name, prompt="def main(", max_tokens=4, temperature=0,
                                           stream=True))
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)  # not asked for: none


def test_echo_gives_the_prompts_logprobs_as_an_evaluation_harness_reads_them(served, model_dir, local):
    """lm-evaluation-harness scores a continuation with {prompt: token ids, echo, max_tokens: 1, logprobs: 1,
    temperature: 0} and reads token_logprobs (and top_logprobs, for "is greedy") over the prompt's tokens: they
    equal transformers' log-softmax of the model at each position before. A text prompt echoes its text; several
    prompts and n samples each get theirs."""
    import torch
    import transformers

    folder, _ = model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = local.tokenizer.encode("def main():\n    return os.path.join(a, b)")
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    body = {"model": served.model_name(), "prompt": [ids], "echo": True, "max_tokens": 1, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    reply = raw(served, "/v1/completions", body).json()
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(ids)):  # the top entry is the position's argmax, as lm-eval's greedy check reads it
        (top,) = logprobs["top_logprobs"][i].values()
        assert top == pytest.approx(float(reference[i - 1].max()), abs=1e-4)
    assert choice["text"].startswith(local.tokenizer.decode(ids)) and reply["usage"]["prompt_tokens"] == len(ids)
    # max_tokens 0: the prompt scored alone (OpenAI's legacy completions), the same log-probs
    alone = raw(served, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 2}).json()
    assert alone["choices"][0]["text"] == local.tokenizer.decode(ids) and alone["usage"]["completion_tokens"] == 0
    assert len(alone["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert alone["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert [len(top) for top in alone["choices"][0]["logprobs"]["top_logprobs"][1:]] == [2] * (len(ids) - 1)
    # a text prompt echoes its text; without logprobs, only the text
    reply = raw(served, "/v1/completions", {"prompt": ["import os", "class A:"], "echo": True, "max_tokens": 3,
                                            "temperature": 0.8, "seed": 2, "n": 2}).json()
    outs = local.generate(["import os", "class A:"], SamplingParams(max_new_tokens=3, temperature=0.8, seed=2, n=2))
    assert [c["text"] for c in reply["choices"]] == [p + s.text for p, o in zip(["import os", "class A:"], outs)
                                                     for s in o.samples]
    assert all(c["logprobs"] is None for c in reply["choices"])


def test_echo_with_logprobs_of_a_rewritten_prompt_is_a_clear_error(model_dir, tmp_path):
    """A prompt tuning adapter puts virtual tokens before the prompt: the prompt's log-probs are then not those of
    the tokens the echoed text holds, so echo with logprobs is a 400 that says so; echo alone serves."""
    import torch
    import transformers
    from peft import PromptTuningConfig, get_peft_model

    folder, _ = model_dir
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(0)
    get_peft_model(base, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).save_pretrained(
        tmp_path / "pt")
    server = Served([f"model.path={folder}", f"+adapters.pt={tmp_path / 'pt'}"], cwd=tmp_path)
    try:
        body = {"model": "pt", "prompt": "def main(", "echo": True, "max_tokens": 2, "temperature": 0}
        reply = raw(server, "/v1/completions", {**body, "logprobs": 1}, key=None)
        assert reply.status_code == 400 and "a prompt that a plugin rewrites" in reply.json()["error"]["message"]
        reply = raw(server, "/v1/completions", body, key=None)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith("def main(")
    finally:
        server.stop()


def test_the_tokenizer_endpoints_equal_transformers_tokenizer(served, model_dir):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-evaluation-harness's remote tokenizer calls them:
    text with and without the special tokens, a chat as the chat endpoint encodes it, and back."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir[0])
    info = raw(served, "/tokenizer_info", method="GET").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == TEMPLATE
    text = "def main():\n    return 1"
    for special in (True, False):
        reply = raw(served, "/tokenize", {"prompt": text, "add_special_tokens": special}).json()
        assert reply["tokens"] == tokenizer(text, add_special_tokens=special)["input_ids"]
        assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] > 0
    assert raw(served, "/tokenize", {"prompt": text}).json()["tokens"] == tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "print hello"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert raw(served, "/tokenize", {"messages": messages}).json()["tokens"] == ids
    reply = raw(served, "/detokenize", {"tokens": ids}).json()
    assert reply["prompt"] == tokenizer.decode(ids, skip_special_tokens=True)
    for path, body, fragment in (("/detokenize", {"tokens": [1, 99999]}, "token ids in [0,"),
                                 ("/detokenize", {"tokens": "1 2"}, "token ids in [0,"),
                                 ("/tokenize", {"prompt": 5}, "prompt (a string) or messages"),
                                 ("/tokenize", {"prompt": "x", "model": "nope"}, "does not exist")):
        reply = raw(served, path, body)
        assert reply.status_code in (400, 404) and fragment in reply.json()["error"]["message"]


def test_vllms_extra_sampling_fields_as_its_benchmark_client_sends_them(served, local, model_dir):
    """vLLM's benchmark_serving sends {model, prompt, temperature: 0, best_of: 1, max_tokens, stream, ignore_eos};
    stop_token_ids and min_p are its other sampling extras; chat_template_kwargs reach the template (a model's
    enable_thinking), as transformers' apply_chat_template passes them."""
    import transformers

    name = served.model_name()
    prompt = "def main():"
    eos = local.engine.description.eos_token_ids[0]
    free = local.generate([prompt], SamplingParams(max_new_tokens=40))[0]
    reply = raw(served, "/v1/completions", {"model": name, "prompt": prompt, "temperature": 0.0, "best_of": 1,
                                            "max_tokens": 40, "stream": False, "ignore_eos": True}).json()
    expected = local.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert reply["choices"][0]["text"] == expected.text and reply["usage"]["completion_tokens"] == 40
    stop_at = free.token_ids[5]
    reply = raw(served, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 40,
                                            "stop_token_ids": [stop_at], "ignore_eos": True}).json()
    expected = local.generate([prompt], SamplingParams(max_new_tokens=40, stop_token_ids=[stop_at], ignore_eos=True))
    assert reply["choices"][0]["text"] == expected[0].text and expected[0].finish_reason == "stop"
    assert reply["choices"][0]["finish_reason"] == "stop" and eos not in expected[0].token_ids
    settings = dict(temperature=0.9, seed=3, min_p=0.2)
    reply = raw(served, "/v1/completions", {"prompt": prompt, "max_tokens": 12, **settings}).json()
    expected = local.generate([prompt], SamplingParams(max_new_tokens=12, **settings))[0]
    assert reply["choices"][0]["text"] == expected.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir[0])
    messages = [{"role": "user", "content": "hi"}]
    lengths = []
    for kwargs in ({}, {"enable_thinking": False}):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        got = raw(served, "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs}).json()["tokens"]
        assert got == ids
        lengths.append(len(ids))
        reply = raw(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                     "chat_template_kwargs": kwargs}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
    assert lengths[1] > lengths[0]  # the variable reached the template
    reply = raw(served, "/v1/chat/completions", {"messages": messages, "chat_template_kwargs": [1]})
    assert reply.status_code == 400 and "chat_template_kwargs must be an object" in reply.json()["error"]["message"]


def test_a_chat_can_continue_the_last_message_as_transformers_renders_it(served, local, model_dir):
    """vLLM's continue_final_message (transformers' apply_chat_template argument of the same name): the prompt
    ends inside the last message, which the model goes on with; add_generation_prompt false renders no
    assistant turn. Both true is a 400."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir[0])
    messages = [{"role": "user", "content": "write a function"}, {"role": "assistant", "content": "def main("}]
    for flags in (dict(continue_final_message=True), dict(add_generation_prompt=False)):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **{"add_generation_prompt": False, **flags})
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        assert raw(served, "/tokenize", {"messages": messages, **flags}).json()["tokens"] == ids
        reply = raw(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                     **flags}).json()
        expected = local.generate([{"prompt_ids": ids}], SamplingParams(max_new_tokens=8))[0]
        assert reply["choices"][0]["message"]["content"] == expected.text
        assert reply["usage"]["prompt_tokens"] == len(ids)
    continued = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert continued.endswith("def main(")  # the prompt ends inside the assistant's message
    for body, fragment in (({"continue_final_message": True, "add_generation_prompt": True}, "must be false"),
                           ({"continue_final_message": "yes"}, "continue_final_message must be true or false")):
        reply = raw(served, "/v1/chat/completions", {"messages": messages, **body})
        assert reply.status_code == 400 and fragment in reply.json()["error"]["message"]


QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
                 " <|vision_start|> <|image_pad|> <|vision_end|> {% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                 "{% endif %} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def test_an_image_in_a_chat_is_served_as_transformers_processes_it(qwen2_vl, tmp_path):
    """A Qwen2-VL checkpoint with a tokenizer and a chat template that writes one image pad per image, as
    Qwen2-VL's does: an image sent as a data URL in a chat message gets transformers' greedy tokens for the
    rendered chat with its pad widened by Qwen2VLProcessor's rule and the image processed by its image
    processor."""
    import base64
    import io

    import torch
    import transformers
    from PIL import Image
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from test_qwen2_vl import IMAGE, image_prompt

    source, model = qwen2_vl
    folder = tmp_path / "qwen"
    shutil.copytree(source, folder)
    specials = {"<|image_pad|>": IMAGE, "<|video_pad|>": 291, "<|vision_start|>": 292, "<|vision_end|>": 293,
                "<|im_start|>": 294, "<|im_end|>": 295, "<unk>": 296}
    words = {f"w{i}": i for i in range(290)}
    tokenizer = Tokenizer(models.WordLevel({**words, **specials}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_TEMPLATE,
                                                             "tokenizer_class": "PreTrainedTokenizerFast"}))
    array = torch.randint(0, 256, (56, 84, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    png = io.BytesIO()
    Image.fromarray(array.numpy()).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w7"}]}]
    # the peer: transformers renders the chat, its image processor reads the image, the pad is widened
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"},
                                                {"type": "text", "text": "w7"}]}]
    short = hf_tokenizer.apply_chat_template(hf_messages, chat_template=QWEN_TEMPLATE, add_generation_prompt=True,
                                             tokenize=True)
    short = short if isinstance(short, list) else short["input_ids"]
    assert short.count(IMAGE) == 1
    processed = transformers.Qwen2VLImageProcessorPil()(images=Image.open(io.BytesIO(png.getvalue())),
                                                        return_tensors="pt")
    grid = tuple(processed["image_grid_thw"][0].tolist())
    at = short.index(IMAGE)
    widened = image_prompt(short[:at - 1], grid, short[at + 2:])
    ids = torch.tensor([widened])
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids),
                                   pixel_values=processed["pixel_values"], image_grid_thw=torch.tensor([grid]),
                                   mm_token_type_ids=(ids == IMAGE).int(), max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)[0, len(widened):].tolist()
    server = Served([f"model.path={folder}", "model=qwen2_vl"], cwd=tmp_path)
    try:
        reply = raw(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True}, key=None).json()
        assert reply["choices"][0]["message"]["content"] == hf_tokenizer.decode(reference, skip_special_tokens=True)
        assert reply["usage"]["completion_tokens"] == 6
    finally:
        server.stop()


def raw(served, path, body=None, key=KEY, method="POST", content=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if method == "GET":
        return httpx.get(served.url + path, headers=headers)
    return httpx.post(served.url + path, headers={**headers, "content-type": "application/json"},
                      content=content if content is not None else json.dumps(body))


def test_auth(served):
    assert raw(served, "/health", method="GET", key=None).status_code == 200
    for path, method in (("/v1/models", "GET"), ("/v1/models/sql", "GET"), ("/metrics", "GET"),
                         ("/v1/completions", "POST"), ("/tokenize", "POST"), ("/tokenizer_info", "GET")):
        for key in (None, "wrong"):
            reply = raw(served, path, {"prompt": "x"}, key=key, method=method)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert raw(served, "/v1/models", method="GET").status_code == 200


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "temprature": 1}, 400, "unknown field(s): temprature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature=-1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_new_tokens=0"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "word " * 300}, 400, "this server takes at most 200"),
    ("/v1/completions", {}, 400, "prompt is required"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix='y' is not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 400, "echo is served without stream"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo is a flag of /v1/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400,
     "echo is a flag of /v1/completions"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "'nope' does not exist"),
    ("/v1/nothing", {"prompt": "x"}, 404, "no endpoint /v1/nothing"),
    ("/v1/completions", {"prompt": "x" * 30000}, 413, "larger than server.max_body_bytes=20000"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "takes no images"),
])
def test_bad_requests_get_openai_errors_and_harm_no_other_request(served, local, path, body, status, fragment):
    client = served.client()
    result = {}

    def good():  # a request running while the bad one arrives
        chunks = client.completions.create(model=served.model_name(), prompt="def f(", max_tokens=30,
                                           temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    thread = threading.Thread(target=good)
    thread.start()
    reply = raw(served, path, body if isinstance(body, dict) else None,
                content=body if isinstance(body, str) else None)
    thread.join(120)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert result["text"] == local.generate(["def f("], SamplingParams(max_new_tokens=30))[0].text


def wait_idle(served, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = served.metrics()
        if m["zoo_kv_blocks_used"] == 0 and m["zoo_requests_running"] == 0 and m["zoo_requests_waiting"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"still busy: {served.metrics()}")


def test_a_client_that_disconnects_frees_its_blocks(served):
    with httpx.stream("POST", served.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "def f(", "max_tokens": 400, "temperature": 0, "stream": True},
                      timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        assert served.metrics()["zoo_requests_running"] >= 1
    wait_idle(served)


def test_load_of_concurrent_streams_with_disconnects(served, local):
    """64 streaming clients of mixed lengths get zoo's tokens while 8 more hang up mid-stream; no block is left."""
    prompts = [f"def f{i}(" for i in range(64)]
    lengths = [4 + (i * 7) % 40 for i in range(64)]
    expected = [o.text for o in local.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])]
    got, errors = [None] * 64, []

    def stream(i):
        try:
            chunks = served.client().completions.create(model=served.model_name(), prompt=prompts[i],
                                                        max_tokens=lengths[i], temperature=0, stream=True)
            got[i] = "".join(c.choices[0].text for c in chunks if c.choices)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    def hang_up(i):
        with httpx.stream("POST", served.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": f"class C{i}:", "max_tokens": 300, "temperature": 0, "stream": True},
                          timeout=60) as reply:
            for k, _ in enumerate(reply.iter_lines()):
                if k >= 3:
                    break

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(64)]
    threads += [threading.Thread(target=hang_up, args=(i,)) for i in range(8)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and time.time() - start < 180
    assert got == expected
    wait_idle(served)


def test_sigterm_finishes_running_requests_and_exits_0(model_dir, tmp_path):
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "server.shutdown_timeout=20"], cwd=tmp_path)  # no key: auth off
    assert httpx.get(server.url + "/v1/models").status_code == 200
    result = {}

    def long_request():
        result["reply"] = server.client(key="unused").completions.create(
            model=server.model_name(), prompt="def f(", max_tokens=150, temperature=0)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.proc.wait(timeout=60) == 0
    assert result["reply"].usage.completion_tokens == 150  # it finished before the server stopped
    assert "zoo.serve stopped" in server.proc.stderr.read()


def test_a_full_queue_answers_429_and_media_stay_off_the_disk(model_dir, tmp_path):
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "runtime.max_num_seqs=1", "server.max_waiting_requests=1"],
                    cwd=tmp_path)
    try:
        name = server.model_name()
        statuses = []

        def long_request():
            try:
                server.client().completions.create(model=name, prompt="def f(", max_tokens=200, temperature=0)
                statuses.append(200)
            except openai.RateLimitError:  # the third may find the queue full too
                statuses.append(429)

        threads = [threading.Thread(target=long_request) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while server.metrics()["zoo_requests_waiting"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        reply = raw(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        assert reply.status_code == 429 and "already waiting" in reply.json()["error"]["message"]
        for t in threads:
            t.join(120)
        assert statuses.count(200) >= 2
        for url, fragment in (("http://example.com/cat.png", "not fetched"), ("/etc/passwd", "refused"),
                              ("file:///etc/passwd", "refused")):
            body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
            reply = raw(server, "/v1/chat/completions", body, key=None)
            assert reply.status_code == 400 and fragment in reply.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("override, message", [
    ("server.port=-1", "server.port=-1: must be an integer in [0, 65535]"),
    ("+server.nosuch=1", "server.nosuch: no such setting"),
    ("server.max_body_bytes=0", "server.max_body_bytes=0: must be an integer >= 1"),
    ("server.hots=x", "server.hots: no such setting (did you mean server.host?)"),
    ("server.engine_threads=0", "server.engine_threads=0: must be an integer >= 1"),
    ("server.stream_interval=0", "server.stream_interval=0: must be an integer >= 1"),
    ("server.http_processes=0", "server.http_processes=0: must be an integer >= 1"),
    ("server.data_parallel_size=0", "server.data_parallel_size=0: must be an integer >= 1"),
    ("runtime.tensor_parallel_size=0", "runtime.tensor_parallel_size=0: must be"),
])
def test_a_bad_server_setting_is_one_line_before_anything_loads(override, message, tmp_path, forked):
    proc = forked.run("zoo.serve", override, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[0].startswith(f"error: {message}")
    assert "Traceback" not in proc.stderr and "loading weights" not in proc.stderr


def test_replicas_of_a_tensor_parallel_engine_or_past_the_gpus_are_one_line(tmp_path):
    """server.data_parallel_size needs an engine of one rank and, on CUDA, a device per replica."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "zoo.serve", "server.data_parallel_size=2",
                           "runtime.tensor_parallel_size=2"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[0] == (
        "error: server.data_parallel_size=2 with runtime.tensor_parallel_size=2: replicas of a tensor-parallel engine "
        "are not supported; set one of them to 1")
    assert "Traceback" not in proc.stderr and "loading weights" not in proc.stderr
    import torch

    if torch.cuda.is_available():  # one replica more than the machine has devices
        replicas = torch.cuda.device_count() + 1
        proc = subprocess.run([sys.executable, "-m", "zoo.serve", f"server.data_parallel_size={replicas}",
                               "runtime.device=cuda"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env=env)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[0].startswith(
            f"error: server.data_parallel_size={replicas}: each replica needs a CUDA device of its own")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_port_in_use_is_one_line(processes, tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "zoo.serve", f"server.port={port}",
                               f"server.http_processes={processes}"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert "Traceback" not in proc.stderr and "zoo serving" not in proc.stderr


def test_the_engine_process_computes_on_the_cores_the_http_process_leaves():
    from zoo.engine_process import engine_threads

    assert engine_threads(None, 1, 2) == 1 and engine_threads(None, 1, 16) == 15
    assert engine_threads(None, 2, 16) == 7 and engine_threads(None, 4, 2) == 1  # tensor-parallel ranks share them
    assert engine_threads(3, 1, 2) == 3  # server.engine_threads as set


def test_a_checkpoint_without_a_tokenizer_takes_token_ids_and_refuses_text(model_dir, tmp_path):
    """No tokenizer.json (a bare converted checkpoint): a text prompt is a 400 saying so, not a server error;
    token ids are served."""
    folder, _ = model_dir
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    server = Served([f"model.path={bare}"], cwd=tmp_path)
    try:
        reply = raw(server, "/v1/completions", {"prompt": "def f(", "max_tokens": 4}, key=None)
        assert reply.status_code == 400 and "no tokenizer.json" in reply.json()["error"]["message"]
        ids = [5, 17, 99, 3]
        reply = raw(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0}, key=None)
        assert reply.status_code == 200 and reply.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 6,
                                                                       "total_tokens": 10}
    finally:
        server.stop()


def engine_process_of(server) -> int:
    """The engine process: the server's child that is not multiprocessing's resource tracker."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"resource_tracker" not in cmdline.read():
                    return int(child)
    raise AssertionError("no engine process")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine process through /proc")
def test_a_dead_engine_process_ends_streams_with_an_error_and_health_says_so(model_dir, tmp_path):
    """The engine runs in a process of its own. If it dies, a running stream ends with an error event and
    [DONE] instead of hanging, /health answers 503, and a new request gets 503 at once."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}"], cwd=tmp_path)
    try:
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "def f(", "max_tokens": 2000, "temperature": 0, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    os.kill(engine_process_of(server), signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert "the engine process stopped (exit status -9)" in lines[-2]  # the stream says how it ended
        assert httpx.get(server.url + "/health").status_code == 503
        reply = raw(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        assert reply.status_code == 503 and "engine process has stopped" in reply.json()["error"]["message"]
    finally:
        server.stop()
    assert server.proc.returncode == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_engine_that_cannot_start_is_one_line(replicas, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zoo.serve", f"model.path={tmp_path / 'missing'}",
                           f"server.data_parallel_size={replicas}", "runtime.device=cpu"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: checkpoint folder {tmp_path / 'missing'} does not exist"
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine process through /proc")
def test_the_engine_process_exits_when_the_http_process_is_killed(model_dir, tmp_path):
    """A server killed outright (SIGKILL, no shutdown) leaves no engine process holding memory behind."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}"], cwd=tmp_path)
    engine = engine_process_of(server)
    server.proc.kill()
    server.proc.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline and os.path.exists(f"/proc/{engine}"):
        with open(f"/proc/{engine}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited; its parent is gone, so nobody reaps it yet
                break
        time.sleep(0.1)
    else:
        assert not os.path.exists(f"/proc/{engine}"), "the engine process outlived the server"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine processes through /proc")
@TWO_RANKS
def test_tensor_parallel_serving_gives_one_process_tokens_and_a_dead_rank_is_503(model_dir, local, tmp_path):
    """runtime.tensor_parallel_size=2 (gloo on CPU): two engine processes, rank 0 handing both the same requests
    each step. Streamed and whole completions, several at once, equal the one-process Python API; a disconnect
    frees its blocks; killing rank 1 makes the server answer 503 rather than hang."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "runtime.tensor_parallel_size=2"], cwd=tmp_path)
    try:
        ranks = spawned_children(server)
        assert len(ranks) == 2
        client, name = server.client(), server.model_name()
        prompts = [f"def g{i}(x" for i in range(6)]
        expected = [o.text for o in local.generate(prompts, SamplingParams(max_new_tokens=12))]
        got = [None] * len(prompts)

        def ask(i):
            if i % 2:
                chunks = client.completions.create(model=name, prompt=prompts[i], max_tokens=12, temperature=0,
                                                   stream=True)
                got[i] = "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                got[i] = client.completions.create(model=name, prompt=prompts[i], max_tokens=12,
                                                   temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == expected
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "def f(", "max_tokens": 400, "temperature": 0, "stream": True}) as reply:
            assert next(reply.iter_lines()).startswith("data: ")
        wait_idle(server)
        os.kill(ranks[1], signal.SIGKILL)
        deadline = time.time() + 30
        while httpx.get(server.url + "/health").status_code != 503 and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(server.url + "/health").status_code == 503
        reply = raw(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        assert reply.status_code == 503
    finally:
        server.stop()


def test_the_engine_loop_sends_tokens_only_for_streams(local):
    """A non-streamed request's handler reads only its output: the engine loop sends no delta events for it, while
    a streamed one beside it gets each step's tokens (text only in the last, once final: the HTTP process decodes
    the rest), which add up to its output's tokens and, through the HTTP process's TextDeltas, to its text."""
    from zoo.llm import TextDeltas
    from zoo.engine_process import EngineLoop

    loop = EngineLoop(local, conns=[object()])  # a connection is only sent to in run(), which this test does not call
    values = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    loop._handle(("add", 1, [({"prompt": "def main():"}, values)], True))
    loop._handle(("add", 2, [({"prompt": "def main():"}, values)], False))
    events = []
    while local.engine.has_work():
        loop._step()
        events += loop.outbox
        loop.outbox = []
    outputs = {ident: e[2] for ident, e in events if e[0] == "finished"}
    assert outputs[1].text == outputs[2].text == local.generate(["def main():"], SamplingParams(**values))[0].text
    streamed = [e for i, e in events if i == 1 and e[0] == "delta"]
    assert not [e for i, e in events if i == 2 and e[0] == "delta"]
    assert [e[4] for e in streamed] == [None] * (len(streamed) - 1) + [outputs[1].text]
    ids, deltas, text = [], TextDeltas(local.tokenizer), ""
    for _, _, _, tokens, final, logprobs in streamed:
        assert logprobs is None  # not asked for
        ids += tokens
        text += deltas.delta_of(0, ids, [], final)
    assert ids == outputs[1].token_ids and outputs[1].text and text == outputs[1].text
    assert not loop.streamed and not loop.requests_of and not deltas.state


def test_the_engine_loop_sends_a_streams_tokens_every_stream_interval(local):
    """server.stream_interval=4: each stream's first token goes out at once, then four at a time, and the rest
    with its final text at its end; with n=2 each sample counts its own. A stream aborted midway leaves
    nothing held."""
    from zoo.engine_process import EngineLoop

    loop = EngineLoop(local, conns=[object()], stream_interval=4)
    greedy = {"max_new_tokens": 11, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    sampled = {"max_new_tokens": 6, "temperature": 0.9, "seed": 3, "n": 2, "ignore_eos": True}
    loop._handle(("add", 1, [({"prompt": "def main():"}, greedy)], True))
    loop._handle(("add", 2, [({"prompt": "import os"}, sampled)], True))
    loop._handle(("add", 3, [({"prompt": "class A:"}, greedy)], True))
    events, steps = [], 0
    while local.engine.has_work():
        loop._step()
        steps += 1
        events += loop.outbox
        loop.outbox = []
        if steps == 3:
            loop._abort(3)
            assert 3 not in loop.held
    outputs = {ident: e[2] for ident, e in events if e[0] == "finished"}
    greedy_deltas = [e for i, e in events if i == 1 and e[0] == "delta"]
    assert [len(e[3]) for e in greedy_deltas] == [1, 4, 4, 2]
    assert [e[4] for e in greedy_deltas] == [None, None, None, outputs[1].text]
    assert sum((e[3] for e in greedy_deltas), []) == outputs[1].token_ids
    # each delta carries its own tokens' log-probs, which join to the output's
    assert [len(e[5]) for e in greedy_deltas] == [1, 4, 4, 2] and [e[5][0]["token_id"] for e in greedy_deltas] == [
        e[3][0] for e in greedy_deltas]
    assert sum((e[5] for e in greedy_deltas), []) == outputs[1].logprobs
    expected = local.generate(["def main():"], SamplingParams(**greedy))[0]
    assert outputs[1].token_ids == expected.token_ids
    for sample in outputs[2].samples:
        deltas = [e for i, e in events if i == 2 and e[0] == "delta" and e[2] == sample.index]
        assert [len(e[3]) for e in deltas] == [1, 4, 1] and all(e[5] is None for e in deltas)
        assert sum((e[3] for e in deltas), []) == sample.token_ids
    assert not loop.held and not loop.requests_of


def test_a_stream_interval_serves_the_same_text_in_fewer_chunks(model_dir, local, tmp_path):
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "server.stream_interval=4"], cwd=tmp_path)
    try:
        client = server.client()
        for settings in (dict(temperature=0.0), dict(temperature=0.8, seed=5)):
            reply = client.completions.create(model=server.model_name(), prompt="def main(", max_tokens=13,
                                              **settings)
            chunks = list(client.completions.create(model=server.model_name(), prompt="def main(", max_tokens=13,
                                                    stream=True, **settings))
            texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
            expected = local.generate(["def main("], SamplingParams(max_new_tokens=13, **settings))[0]
            assert reply.choices[0].text == "".join(texts) == expected.text
            # the first token, then 4 at a time: at most 4 chunks (fewer where a handler that woke late merged
            # what had queued, which a loaded machine makes happen; the engine loop's test pins the pattern)
            assert 1 <= len(texts) <= 4
        # each of n samples held on its own, and a stop string cutting a held stream where it cuts the output
        text = local.generate(["def main("], SamplingParams(max_new_tokens=13, temperature=0.0))[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        for settings in (dict(temperature=0.9, seed=4, n=2), dict(temperature=0.0, stop=[stop])):
            reply = client.completions.create(model=server.model_name(), prompt="def main(", max_tokens=13,
                                              **settings)
            chunks = list(client.completions.create(model=server.model_name(), prompt="def main(", max_tokens=13,
                                                    stream=True, **settings))
            for choice in reply.choices:
                mine = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index]
                assert "".join(mine) == choice.text
        assert stop and reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()


def test_the_engine_loop_takes_a_text_prompts_ids_as_the_http_process_sent_them(local, monkeypatch):
    """The HTTP process encodes every text prompt for its length check and sends the ids with the text: the
    engine process, the busier one, does not encode it again, and the output is the text prompt's."""
    from zoo.engine_process import EngineLoop

    prompt = "def main():"
    ids = local.tokenizer.encode(prompt)
    values = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    expected = local.generate([prompt], SamplingParams(**values))[0]

    def refuse(text):
        raise AssertionError(f"the engine encoded {text!r} again")

    monkeypatch.setattr(local.engine.tokenizer, "encode", refuse)
    loop = EngineLoop(local, conns=[object()])
    loop._handle(("add", 1, [({"prompt": prompt, "prompt_ids": ids}, values)], False))
    events = []
    while local.engine.has_work():
        loop._step()
        events += loop.outbox
        loop.outbox = []
    (output,) = [e[2] for _, e in events if e[0] == "finished"]
    assert output.token_ids == expected.token_ids and output.text == expected.text


def test_a_stream_never_shows_text_a_stop_string_cuts(served, local):
    """A stream holds back what may start a stop string: the streamed text equals the cut output."""
    client = served.client()
    full = client.completions.create(model=served.model_name(), prompt="def main(", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a string the output reaches in its middle
    assert stop
    reply = client.completions.create(model=served.model_name(), prompt="def main(", max_tokens=24, temperature=0,
                                      stop=[stop])
    chunks = list(client.completions.create(model=served.model_name(), prompt="def main(", max_tokens=24,
                                            temperature=0, stop=[stop], stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == reply.choices[0].text == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_engine_computes_on_the_cores_it_may_use_less_one_for_http():
    """server.engine_threads: a setting wins; else the cores this process may run on (taskset, a cpuset), less one
    for the HTTP process, shared by the tensor-parallel ranks, at least one."""
    from zoo.engine_process import engine_threads, usable_cores

    assert usable_cores() == len(os.sched_getaffinity(0))
    assert engine_threads(3, 1, 2) == 3
    assert [engine_threads(None, 1, cores) for cores in (1, 2, 8)] == [1, 1, 7]
    assert engine_threads(None, 2, 9) == 4
    assert [engine_threads(None, 1, cores, http_processes=2) for cores in (2, 8)] == [1, 6]
    assert [engine_threads(None, 1, cores, replicas=2) for cores in (2, 3, 9)] == [1, 1, 4]  # replicas share them
    if shutil.which("taskset"):  # a process started on one core counts one
        script = "from zoo.engine_process import usable_cores; print(usable_cores())"
        pinned = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-c", script],
                                capture_output=True, text=True, timeout=60)
        assert pinned.stdout.strip() == "1", pinned.stderr


def connection_owners(server, pids) -> set[int]:
    """Which of ``pids`` hold an established connection to the server's port (Linux: /proc/net/tcp, each
    process's sockets through its file descriptors)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == server.port and fields[3] == "01":  # local port, ESTABLISHED
                inodes.add(fields[9])
    owners = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    owners.add(pid)
        except FileNotFoundError:  # a descriptor closed meanwhile
            continue
    return owners


def http_processes_of(server) -> list[int]:
    """The server process and its HTTP children (``zoo-http-N``: spawned, their command line says spawn_main),
    not the engine process or multiprocessing's resource tracker."""
    engine = engine_process_of(server)
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    others = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as cmdline:
            if child != engine and b"resource_tracker" not in cmdline.read():
                others.append(child)
    return [server.proc.pid] + others


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_several_http_processes_share_the_socket_and_the_engine(model_dir, local, tmp_path):
    """server.http_processes=2 (vLLM's --api-server-count): both processes accept connections on the one port and
    hand their requests to the one engine process, each getting its own requests' tokens; a disconnect frees its
    blocks; SIGTERM lets every running request finish and stops every process with exit status 0."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "server.http_processes=2", "server.shutdown_timeout=30"], cwd=tmp_path)
    try:
        pids = http_processes_of(server)
        assert len(pids) == 2
        client, name = server.client(key="unused"), server.model_name()
        prompts = [f"def h{i}(x" for i in range(12)]
        lengths = [6 + (i * 5) % 30 for i in range(12)]
        expected = [o.text for o in local.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])]
        owners, errors = set(), []
        for _ in range(5):  # which process accepts a connection is the kernel's choice: until both have
            got = [None] * len(prompts)
            holding = threading.Barrier(len(prompts) + 1)

            def ask(i):
                try:
                    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                                      json={"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0,
                                            "stream": True}) as reply:
                        lines = reply.iter_lines()
                        text = json.loads(next(lines)[6:])["choices"][0]["text"]
                        holding.wait(60)  # every connection open at once
                        holding.wait(60)
                        for line in lines:
                            if line.startswith("data: {"):
                                text += json.loads(line[6:])["choices"][0]["text"]
                    got[i] = text
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            holding.wait(60)
            owners |= connection_owners(server, pids)
            holding.wait(60)
            for t in threads:
                t.join(120)
            assert not errors and got == expected
            if owners == set(pids):
                break
        assert owners == set(pids)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "def f(", "max_tokens": 400, "temperature": 0, "stream": True}) as reply:
            assert next(reply.iter_lines()).startswith("data: ")
        wait_idle(server)
        results = {}

        def long_request(i):
            results[i] = client.completions.create(model=name, prompt=prompts[i], max_tokens=150, temperature=0)

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert server.proc.wait(timeout=90) == 0
        assert [results[i].usage.completion_tokens for i in range(6)] == [150] * 6  # finished before the stop
        for pid in pids[1:]:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        server.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the listening sockets in /proc")
def test_port_0_is_the_one_port_the_system_chose_for_every_http_process(model_dir, tmp_path):
    folder, _ = model_dir
    proc = subprocess.Popen([sys.executable, "-m", "zoo.serve", f"model.path={folder}", "server.port=0",
                             "server.http_processes=2"], stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = ""
        while "zoo serving" not in line:
            line = proc.stderr.readline()
            assert line, "the server stopped before serving"
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        assert port > 0 and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        with open("/proc/net/tcp") as f:  # listening (state 0A) on that port: one socket per HTTP process
            listening = [row for row in f.read().splitlines()[1:]
                         if row.split()[3] == "0A" and int(row.split()[1].split(":")[1], 16) == port]
        assert len(listening) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_an_http_process_that_dies_stops_the_server_with_one_line(model_dir, tmp_path):
    """The second HTTP process killed outright: the server says which one stopped, stops the others and the
    engine, and exits 1 instead of serving on with half its connections cut."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "server.http_processes=2"], cwd=tmp_path)
    try:
        pids = http_processes_of(server)
        engine = engine_process_of(server)
        os.kill(pids[1], signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        stderr = server.proc.stderr.read()
        assert "error: zoo-http-1 stopped (exit status -9); stopping the server" in stderr
        assert "Traceback" not in stderr
        deadline = time.time() + 30
        while time.time() < deadline and os.path.exists(f"/proc/{engine}"):
            if open(f"/proc/{engine}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.1)
        else:
            assert not os.path.exists(f"/proc/{engine}"), "the engine process outlived the server"
    finally:
        server.stop()


def test_the_engine_loop_answers_each_http_process_on_its_own_pipe(local):
    """Two HTTP processes' pipes into one engine loop: each gets only its own requests' events (process i numbers
    its requests i, i + 2, ...); when one stops, its running requests are aborted and the other's go on; when both
    have, the loop ends."""
    import multiprocessing

    from zoo.engine_process import EngineLoop

    values = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    expected = local.generate(["def main():", "import os"], SamplingParams(**values))  # before the loop's thread
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    loop = EngineLoop(local, [child for _, child in pipes])
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    long = {"max_new_tokens": local.engine.max_model_len - 8, "temperature": 0.0, "ignore_eos": True}
    first, second = pipes[0][0], pipes[1][0]
    first.send(("add", 2, [({"prompt": "def main():"}, values)], True))
    second.send(("add", 3, [({"prompt": "import os"}, values)], True))
    second.send(("add", 5, [({"prompt": "class A:"}, long)], True))

    def events_until(conn, done):
        seen = []
        while not done(seen):
            assert conn.poll(60), "no events"
            seen += conn.recv()[1]
        return seen

    mine = events_until(first, lambda seen: any(e[0] == "finished" for _, e in seen))
    theirs = events_until(second, lambda seen: any(e[0] == "finished" for _, e in seen))
    assert {ident for ident, _ in mine} == {2} and {ident for ident, _ in theirs} <= {3, 5}
    assert [e[2].token_ids for _, e in mine if e[0] == "finished"] == [expected[0].token_ids]
    assert [e[2].token_ids for _, e in theirs if e[0] == "finished"] == [expected[1].token_ids]
    assert 5 in loop.requests_of and not [e for _, e in theirs if e[0] == "error"]
    second.send(("stop", None))  # its long request is aborted; the first pipe is still served
    deadline = time.time() + 60
    while loop.requests_of and time.time() < deadline:
        time.sleep(0.05)
    assert not loop.requests_of and not local.engine.has_work()
    first.send(("add", 4, [({"prompt": "def main():"}, values)], False))
    again = events_until(first, lambda seen: any(e[0] == "finished" for _, e in seen))
    assert [e[2].token_ids for _, e in again if e[0] == "finished"] == [expected[0].token_ids]
    first.close()  # the last one gone: the loop ends
    runner.join(60)
    assert not runner.is_alive()


def process_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: [11] user and [12] system time in ticks, [19] start time."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def spawned_children(server) -> list[int]:
    """The server's children in the order they started, multiprocessing's resource tracker aside."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    spawned = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as cmdline:
            if b"resource_tracker" not in cmdline.read():
                spawned.append(child)
    return sorted(spawned, key=lambda pid: int(process_stat(pid)[19]))


def engine_processes_of(server, count: int) -> list[int]:
    """The server's engine processes: its first ``count`` children, which start before any other HTTP process."""
    return spawned_children(server)[:count]


def cpu_seconds_of(pid: int) -> float:
    fields = process_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine processes through /proc")
def test_engine_replicas_share_the_requests_and_free_their_blocks(model_dir, local, tmp_path):
    """server.data_parallel_size=2 (vLLM's --data-parallel-size) behind two HTTP processes: both engine processes
    compute, every request gets zoo's tokens, clients that hang up free their blocks on whichever replica ran them,
    and SIGTERM stops every process with exit status 0."""
    folder, _ = model_dir
    server = Served([f"model.path={folder}", "server.data_parallel_size=2", "server.http_processes=2"], cwd=tmp_path)
    try:
        engines = engine_processes_of(server, 2)
        before = [cpu_seconds_of(pid) for pid in engines]
        client, name = server.client(key="unused"), server.model_name()
        prompts = [f"def r{i}(x" for i in range(16)]
        lengths = [20 + (i * 7) % 40 for i in range(16)]
        expected = [o.text for o in local.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])]
        got, errors = [None] * len(prompts), []

        def ask(i):
            try:
                chunks = client.completions.create(model=name, prompt=prompts[i], max_tokens=lengths[i],
                                                   temperature=0, stream=True)
                got[i] = "".join(c.choices[0].text for c in chunks if c.choices)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        def hang_up(i):
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": f"class R{i}:", "max_tokens": 1500, "temperature": 0,
                                    "stream": True}) as reply:
                for k, _ in enumerate(reply.iter_lines()):
                    if k >= 3:
                        break

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        threads += [threading.Thread(target=hang_up, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and got == expected
        spent = [cpu_seconds_of(pid) - start for pid, start in zip(engines, before)]
        assert min(spent) > 0.05, spent  # each replica stepped some of the requests (an idle one waits on its pipes)
        metrics = wait_idle(server)
        # the hung-up requests were aborted on their replicas, not run to their 1500 tokens
        assert metrics["zoo_generated_tokens_total"] < sum(lengths) + 4 * 300, metrics
        assert metrics["zoo_kv_blocks_total"] > 0
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=90) == 0
        assert "(2 HTTP processes, 2 engine replicas)" in server.proc.stderr.read()
        for pid in engines:
            assert not os.path.exists(f"/proc/{pid}") or process_stat(pid)[0] == "Z"
    finally:
        server.stop()
