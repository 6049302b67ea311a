"""An OpenAI-compatible HTTP server on zoo's engine: ``python -m zoo.serve``.

    python -m zoo.serve model.path=DIR +adapters.sql=PEFT_DIR server.port=8000

Starlette (through FastAPI) and uvicorn handle HTTP (the ``serve`` extra); zoo supplies one engine loop. The
engine runs in a process of its own (:mod:`zoo.engine_process`): handlers hand it requests and aborts through a
pipe, and it sends each step's tokens back in one message, which a reader thread hands to the handlers' event
loop, so every HTTP request joins the running continuous batch as it arrives. Streams turn their tokens into text in the HTTP
process, beside the engine's steps. Endpoints: ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with ``stream``: server-sent events ending in ``data: [DONE]``),
``GET /v1/models`` (the base model and every adapter; a request selects an adapter by its name in ``model``),
``GET /health`` and ``GET /metrics`` (Prometheus).

Safe by default: it binds 127.0.0.1; ``server.api_key`` (or ``$ZOO_API_KEY``) requires ``Authorization:
Bearer`` on every endpoint but ``/health``; bodies and prompts are capped; no request reads a file of the
server's disk (images come as data URLs; paths only beneath ``server.allowed_media_dir``); every bad request
gets an OpenAI-shaped error with status 400, 401, 404, 413 or 429 and leaves the others alone.
"""


import asyncio
import base64
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from omegaconf import DictConfig

from zoo.engine_process import EngineClient, EngineReplicas, EngineStopped, Submission, engine_of
from zoo.errors import EXIT_BAD_SETTING, ZooError


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_exceeded", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------- requests

SAMPLING_FIELDS = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "n": "n",
                   "seed": "seed", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "stop": "stop", "min_tokens": "min_new_tokens", "top_k": "top_k",
                   "repetition_penalty": "repetition_penalty",
                   # vLLM's extra sampling fields, which its benchmark client sends (ignore_eos)
                   "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "min_p": "min_p"}
# read elsewhere, or without effect on the tokens (user, store, metadata, service_tier)
OTHER_FIELDS = {"model", "stream", "user", "logprobs", "top_logprobs", "logit_bias", "stream_options", "prompt",
                "messages", "max_completion_tokens", "service_tier", "store", "metadata", "echo",
                "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
# OpenAI fields zoo does not serve: refused when set to anything but their no-op value
UNSERVED_FIELDS = {"suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
                   "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
                   "parallel_tool_calls": (None, False, True)}


class Server:
    def __init__(self, cfg: DictConfig, engine: EngineClient | EngineReplicas):
        self.cfg, self.server = cfg, cfg.server
        self.engine, info = engine, engine.info
        self.tokenizer, self.adapters = info["tokenizer"], info["adapters"]
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self.api_key = self.server.api_key or os.environ.get("ZOO_API_KEY") or None
        path = cfg.model.get("path")
        self.model_name = self.server.served_model_name or (Path(str(path)).name if path else "zoo-default")
        self.max_prompt = int(self.server.max_prompt_tokens or self.max_model_len - 1)
        config_path = Path(info["folder"]) / "tokenizer_config.json" if info["folder"] is not None else None
        self.tokenizer_config = (json.loads(config_path.read_text())
                                 if config_path is not None and config_path.exists() else {})
        self.template = chat_template(self.tokenizer_config)
        self.media_dir = Path(self.server.allowed_media_dir).resolve() if self.server.allowed_media_dir else None
        self.takes_images = info["takes_images"]
        self.media_tmp = tempfile.TemporaryDirectory(prefix="zoo_serve_media_")

    # ------------------------------------------------------------------ checks

    def check_auth(self, headers) -> None:
        if self.api_key is None:
            return
        given = headers.get("authorization", "")
        if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].strip(), self.api_key)):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    def adapter_for(self, model) -> str | None:
        if model is None or model == self.model_name:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise APIError(404, f"the model {model!r} does not exist; GET /v1/models lists "
                            f"{', '.join(self.model_names())}", param="model", code="model_not_found")

    def model_names(self) -> list[str]:
        return [self.model_name] + self.adapters

    def sampling(self, body: dict) -> dict:
        unknown = sorted(set(body) - set(SAMPLING_FIELDS) - OTHER_FIELDS - set(UNSERVED_FIELDS))
        if unknown:
            raise APIError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        for name, no_op in UNSERVED_FIELDS.items():
            if name in body and body[name] not in no_op:
                raise APIError(400, f"{name}={body[name]!r} is not supported by this server", param=name)
        values = {zoo: body[openai] for openai, zoo in SAMPLING_FIELDS.items() if body.get(openai) is not None}
        values.setdefault("temperature", 1.0)  # OpenAI's default, where zoo's own is greedy
        values.setdefault("max_new_tokens", 16 if "messages" not in body else
                          max(1, min(512, self.max_model_len // 2)))
        if body.get("max_completion_tokens") is not None:
            values["max_new_tokens"] = body["max_completion_tokens"]
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        logprobs = body.get("logprobs")
        if "messages" in body:  # chat: logprobs is a flag, top_logprobs the count
            if logprobs:
                values["logprobs"] = int(body.get("top_logprobs") or 0)
        elif logprobs is not None:
            values["logprobs"] = logprobs
        if body.get("echo") not in (None, False):
            if body["echo"] is not True or "messages" in body:
                raise APIError(400, "echo is a flag of /v1/completions", param="echo")
            if body.get("stream"):
                raise APIError(400, "echo is served without stream: true", param="echo")
            if logprobs is not None:  # the prompt's tokens get theirs too, as evaluation harnesses read them
                values["prompt_logprobs"] = logprobs
            if body.get("max_tokens") == 0:  # the prompt scored alone (OpenAI's legacy completions): the one token
                values["max_new_tokens"] = 1  # the engine generates is left out of the reply (prompt_only)
        if body.get("logit_bias"):
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in dict(body["logit_bias"]).items()}
            except (TypeError, ValueError):
                raise APIError(400, "logit_bias must map token ids to numbers", param="logit_bias") from None
        from zoo.sampling_params import SamplingParams

        try:
            SamplingParams.from_dict(values).validate(self.vocab_size)
        except ZooError as exc:
            raise APIError(400, str(exc)) from None
        return values

    def prompt_items(self, prompt, adapter: str | None, images=None, rendered_chat: bool = False) -> list[dict]:
        """One request dict per prompt: text, token ids, or a list of either. ``rendered_chat``: text from the chat
        template, which writes its own special tokens (a BOS): encoded without the tokenizer adding them again,
        as transformers' ``apply_chat_template`` and vLLM's chat endpoint do."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of either",
                           param="prompt")
        items = []
        for p in prompts:
            item = {"prompt": p} if isinstance(p, str) else {"prompt_ids": p}
            try:
                ids = self.tokenizer.encode(p, add_special_tokens=not rendered_chat) if isinstance(p, str) else p
            except ZooError as exc:  # a checkpoint without tokenizer.json takes token ids only
                raise APIError(400, str(exc), param="prompt") from None
            if len(ids) > self.max_prompt:
                raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt}",
                               param="prompt", code="context_length_exceeded")
            item["prompt_ids"] = ids  # the engine process, the busier one, need not encode the text again
            if adapter is not None:
                item["adapter"] = adapter
            if images:
                item["images"] = images
            items.append(item)
        return items

    def chat_prompt(self, body: dict) -> tuple[str, list]:
        """A chat request's ``messages`` rendered, and their images. vLLM's extras: ``chat_template_kwargs``, more
        variables for the template (a model's ``enable_thinking``); ``add_generation_prompt`` (default true); and
        ``continue_final_message``, which ends the prompt inside the last message, for the model to go on with
        it (an assistant's answer begun by the client)."""
        messages, template_kwargs = body.get("messages"), body.get("chat_template_kwargs") or {}
        generation_prompt = body.get("add_generation_prompt", True)
        continued = body.get("continue_final_message", False)
        if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
            raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        for name, value in (("add_generation_prompt", generation_prompt), ("continue_final_message", continued)):
            if not isinstance(value, bool):
                raise APIError(400, f"{name} must be true or false", param=name)
        if generation_prompt and continued and "add_generation_prompt" in body:
            raise APIError(400, "continue_final_message goes on with the last message: add_generation_prompt must "
                                "be false", param="continue_final_message")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        if self.template is None:
            raise APIError(400, "this model's tokenizer_config.json has no chat_template; use /v1/completions",
                           param="messages")
        images, plain = [], []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):  # parts: text and images
                parts = []
                for part in content:
                    if not isinstance(part, dict):
                        raise APIError(400, "a content part must be an object", param="messages")
                    if part.get("type") == "text":
                        parts.append({"type": "text", "text": str(part.get("text", ""))})
                    elif part.get("type") == "image_url":
                        images.append(self.image(part.get("image_url")))
                        parts.append({"type": "image"})
                    else:
                        raise APIError(400, f"content part type {part.get('type')!r} is not supported",
                                       param="messages")
                # with images, the parts as transformers hands them to a template (which places each image's
                # tokens); text alone, one string, which every template takes
                content = parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)
            elif content is not None and not isinstance(content, str):
                raise APIError(400, "message content must be a string or a list of parts", param="messages")
            plain.append({**message, "content": content or ""})
        marker = f"<zoo-continue-{secrets.token_hex(8)}>" if continued else ""
        if continued:  # rendered with a marker after the last message's text, then cut there
            if not isinstance(plain[-1]["content"], str):
                raise APIError(400, "continue_final_message takes a last message of text",
                               param="continue_final_message")
            plain[-1]["content"] += marker
        try:
            text = self.template.render(**{**template_kwargs, "messages": plain,
                                           "add_generation_prompt": generation_prompt and not continued,
                                           "bos_token": self.special("bos_token"),
                                           "eos_token": self.special("eos_token")})
        except Exception as exc:  # noqa: BLE001 - the checkpoint's template raised: the request's fault or its
            raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        if continued:
            if text.count(marker) != 1:
                raise APIError(400, "this chat template does not keep the last message's text whole, so "
                                    "continue_final_message cannot end the prompt inside it",
                               param="continue_final_message")
            text = text[:text.index(marker)]
        return text, images

    def special(self, name: str) -> str:
        value = self.tokenizer_config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def image(self, spec) -> str:
        """A path the image plugin reads: a data URL written to the server's temporary folder, or a file beneath
        server.allowed_media_dir; anything else is refused."""
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise APIError(400, "image_url.url must be a string", param="messages")
        if url.startswith("data:"):
            header, _, data = url.partition(",")
            if ";base64" not in header:
                raise APIError(400, "an image data URL must be base64", param="messages")
            try:
                raw = base64.b64decode(data, validate=True)
            except ValueError:
                raise APIError(400, "the image data URL is not valid base64", param="messages") from None
            self.need_images()
            path = Path(self.media_tmp.name) / f"{secrets.token_hex(8)}.img"
            path.write_bytes(raw)
            return str(path)
        if url.startswith(("http://", "https://")):
            raise APIError(400, "image URLs are not fetched: send the image as a data URL", param="messages")
        if self.media_dir is None:
            raise APIError(400, "images from the server's disk are refused (server.allowed_media_dir is not set); "
                                "send a data URL", param="messages")
        path = Path(url.removeprefix("file://"))
        resolved = (self.media_dir / path).resolve() if not path.is_absolute() else path.resolve()
        if not resolved.is_relative_to(self.media_dir) or not resolved.is_file():
            raise APIError(400, f"{url!r} is not a file beneath server.allowed_media_dir", param="messages")
        self.need_images()
        return str(resolved)

    def need_images(self) -> None:
        if not self.takes_images:
            raise APIError(400, "this model takes no images", param="messages")

    # ------------------------------------------------------------------ responses

    def logprobs_of(self, entries: list[dict] | None, chat: bool):
        """zoo's log-prob entries of some tokens (an output's, or a stream chunk's) in OpenAI's shape."""
        if entries is None:
            return None
        decode = self.tokenizer.decode
        if chat:
            return {"content": [{"token": decode([e["token_id"]]), "logprob": e["logprob"],
                                 "top_logprobs": [{"token": decode([t]), "logprob": v} for t, v in e.get("top", [])]}
                                for e in entries]}
        return {"tokens": [decode([e["token_id"]]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{decode([t]): v for t, v in e.get("top", [])} for e in entries]}

    def echoed_logprobs(self, output, sample, prompt_only: bool) -> dict | None:
        """``echo`` with ``logprobs``: the prompt's tokens (the first without a log-prob, as OpenAI's), then the
        completion's unless ``prompt_only``, in the completions shape."""
        if sample.logprobs is None:
            return None
        decode, prompt = self.tokenizer.decode, output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        if len(prompt) != len(output.prompt_token_ids):  # a plugin rewrote the prompt (prompt tuning's virtual
            # tokens, an image's widened pads): its log-probs are not those of the tokens the text echoes
            raise APIError(400, "echo with logprobs is not served for a prompt that a plugin rewrites (a prompt "
                                "tuning adapter, images); ask without logprobs", param="echo")
        generated = self.logprobs_of([] if prompt_only else sample.logprobs, False)
        return {"tokens": [decode([t]) for t in output.prompt_token_ids] + generated["tokens"],
                "token_logprobs": [e and e["logprob"] for e in prompt] + generated["token_logprobs"],
                "top_logprobs": [e and {decode([t]): v for t, v in e.get("top", [])} for e in prompt]
                + generated["top_logprobs"]}

    def choices(self, outputs, chat: bool, echoes: list[str] | None = None,
                prompt_only: bool = False) -> tuple[list, dict]:
        """The reply's choices and usage; ``echoes``: each prompt's text, to stand before its completions (echo);
        ``prompt_only``: echo with max_tokens 0, the prompts alone."""
        choices, completion = [], 0
        for position, output in enumerate(outputs):
            samples = output.samples or [output]
            for sample in samples:
                index = position * len(samples) + getattr(sample, "index", 0)
                completion += 0 if prompt_only else len(sample.token_ids)
                finish = sample.finish_reason if sample.finish_reason in ("stop", "length") else "stop"
                if chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": sample.text},
                                    "finish_reason": finish, "logprobs": self.logprobs_of(sample.logprobs, True)})
                elif echoes is not None:
                    choices.append({"index": index, "text": echoes[position] + ("" if prompt_only else sample.text),
                                    "finish_reason": "length" if prompt_only else finish,
                                    "logprobs": self.echoed_logprobs(output, sample, prompt_only)})
                else:
                    choices.append({"index": index, "text": sample.text, "finish_reason": finish,
                                    "logprobs": self.logprobs_of(sample.logprobs, False)})
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        return choices, {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}


def chat_template(tokenizer_config: dict):
    """The checkpoint's chat template (tokenizer_config.json), compiled as transformers does: a sandboxed jinja2
    environment with ``raise_exception`` and ``tojson``; None when the checkpoint has none."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


# ---------------------------------------------------------------------------------------------- the app

def build_app(server: Server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from zoo.llm import TextDeltas

    app = FastAPI(title="zoo", docs_url=None, redoc_url=None, openapi_url=None)
    limit = int(server.server.max_body_bytes)
    waiting_cap = int(server.server.max_waiting_requests)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read_body(request: Request) -> dict:
        server.check_auth(request.headers)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than server.max_body_bytes={limit}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise APIError(413, f"the request body is larger than server.max_body_bytes={limit}")
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    async def read_request(request: Request) -> dict:
        """A generation request's body, unless the engine's queue is full."""
        body = await read_body(request)
        if server.engine.state["waiting"] >= waiting_cap:
            raise APIError(429, f"{waiting_cap} requests are already waiting; retry later")
        return body

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "the engine process has stopped"}, status_code=503)
        return {"status": "ok"}

    def model_card(name: str, created: int) -> dict:
        # max_model_len as vLLM gives it: clients (editor plugins) size their prompts by it
        return {"id": name, "object": "model", "created": created, "owned_by": "zoo", "root": server.model_name,
                "parent": None if name == server.model_name else server.model_name,
                "max_model_len": server.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request.headers)
        created = int(time.time())
        return {"object": "list", "data": [model_card(name, created) for name in server.model_names()]}

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):  # OpenAI's "retrieve model"
        server.check_auth(request.headers)
        server.adapter_for(name)  # 404 for a name that is not served
        return model_card(name, int(time.time()))

    # vLLM's tokenizer endpoints, which clients such as lm-evaluation-harness's remote tokenizer call, so that
    # they need no copy of the checkpoint's tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        server.adapter_for(body.get("model"))
        if "messages" in body:  # as the chat endpoint renders and encodes them
            text, _ = server.chat_prompt(body)
            special = bool(body.get("add_special_tokens", False))
        elif isinstance(body.get("prompt"), str):
            text, special = body["prompt"], bool(body.get("add_special_tokens", True))
        else:
            raise APIError(400, "tokenize needs prompt (a string) or messages", param="prompt")
        try:
            tokens = server.tokenizer.encode(text, add_special_tokens=special)
        except ZooError as exc:  # a checkpoint without tokenizer.json
            raise APIError(400, str(exc), param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        server.adapter_for(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < server.vocab_size for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {server.vocab_size})", param="tokens")
        return {"prompt": server.tokenizer.decode(tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        server.check_auth(request.headers)
        config = server.tokenizer_config
        info = {name: server.special(name) or None for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {**info, "chat_template": config.get("chat_template"), "model_max_length": server.max_model_len,
                "tokenizer_class": config.get("tokenizer_class")}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.check_auth(request.headers)
        return PlainTextResponse(prometheus_text(server), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        body = await read_request(request)
        adapter = server.adapter_for(body.get("model"))
        values = server.sampling(body)
        if chat:
            text, images = server.chat_prompt(body)
            items = server.prompt_items(text, adapter, images, rendered_chat=True)
        else:
            if "prompt" not in body:
                raise APIError(400, "prompt is required", param="prompt")
            items = server.prompt_items(body["prompt"], adapter)
        loop = asyncio.get_running_loop()
        submission = Submission([(item, values) for item in items], loop, asyncio.Queue(),
                                stream=bool(body.get("stream")))
        try:
            server.engine.submit(submission)
        except EngineStopped as exc:
            raise APIError(503, str(exc)) from None
        kind = "chat.completion" if chat else "text_completion"
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        model = body.get("model") or server.model_name
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(request, submission, chat, ident, created, model, len(items),
                                            values.get("n", 1), values.get("stop") or [], include_usage),
                                     media_type="text/event-stream")
        outputs = [None] * len(items)
        try:
            while None in outputs:  # counted here: the engine thread's events may still be on their way
                event = await submission.events.get()
                if event[0] == "finished":
                    outputs[event[1]] = event[2]
                elif event[0] == "error":
                    server.engine.abort(submission)
                    raise APIError(503, event[1])
        except asyncio.CancelledError:  # the client went away
            server.engine.abort(submission)
            raise
        failed = next((o for o in outputs if o.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(400, failed.error)
        echoes = ([item["prompt"] if "prompt" in item else server.tokenizer.decode(item["prompt_ids"])
                   for item in items] if body.get("echo") else None)
        choices, usage = server.choices(outputs, chat, echoes, prompt_only=body.get("max_tokens") == 0)
        return {"id": ident, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage}

    async def stream(request, submission, chat, ident, created, model, prompts, n, stops, include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
        deltas, token_ids = TextDeltas(server.tokenizer), {}  # choice -> its tokens so far

        def chunk(choices, usage=None):
            data = {"id": ident, "object": kind, "created": created, "model": model, "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        # The chunk every token goes out in, as a template: only the text is encoded per chunk (the HTTP process
        # writes one for every stream at every step)
        head = chunk([{"index": 0}])[:-len('{"index": 0}]}\n\n')].replace("%", "%%")
        delta_template = head + ('{"index": %d, "delta": {"content": %s}, "finish_reason": null, "logprobs": null}]}'
                                 if chat else '{"index": %d, "text": %s, "finish_reason": null, "logprobs": null}]}')
        delta_template += "\n\n"

        def delta_chunk(choice, text, logprobs=None):
            if logprobs is None:
                return delta_template % (choice, json.dumps(text))
            body = {"delta": {"content": text}} if chat else {"text": text}
            return chunk([{"index": choice, **body, "finish_reason": None,
                           "logprobs": server.logprobs_of(logprobs, chat)}])

        outputs = [None] * prompts
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None} for i in range(prompts * n)])
            failed = False
            while None in outputs and not failed:
                # Everything queued since the last wake-up goes out in one write, each choice's new text in one
                # chunk: under load a client gets fewer, longer chunks instead of the server falling behind.
                events = [await submission.events.get()]
                while not submission.events.empty():
                    events.append(submission.events.get_nowait())
                # pending: choice -> text not yet written, in order of arrival; and its tokens' log-probs
                parts, pending, pending_logprobs = [], {}, {}

                def write_pending():
                    parts.extend(delta_chunk(choice, text, pending_logprobs.pop(choice, None))
                                 for choice, text in pending.items())
                    pending.clear()

                for event in events:
                    if event[0] == "delta":
                        _, index, sample, tokens, final, logprobs = event
                        choice = index * n + sample
                        ids = token_ids.setdefault(choice, [])
                        ids.extend(tokens)
                        pending[choice] = pending.get(choice, "") + deltas.delta_of(choice, ids, stops, final)
                        if logprobs is not None:
                            pending_logprobs.setdefault(choice, []).extend(logprobs)
                        continue
                    write_pending()
                    if event[0] == "finished":
                        _, index, output = event
                        outputs[index] = output
                        if output.finish_reason == "error":
                            parts.append(f"data: {json.dumps(APIError(400, output.error).body())}\n\n")
                            continue
                        for sample in output.samples or [output]:
                            choice = index * n + getattr(sample, "index", 0)
                            if choice in deltas.state:  # text held back (a partial character, what might begin
                                # a stop string) by a stream whose last step brought no tokens
                                rest = deltas.delta_of(choice, token_ids[choice], stops, sample.text)
                                if rest:
                                    parts.append(delta_chunk(choice, rest))
                            finish = sample.finish_reason if sample.finish_reason in ("stop", "length") else "stop"
                            if chat:
                                parts.append(chunk([{"index": choice, "delta": {}, "finish_reason": finish,
                                                     "logprobs": None}]))
                            else:
                                parts.append(chunk([{"index": choice, "text": "", "finish_reason": finish,
                                                     "logprobs": None}]))
                    elif event[0] == "error":
                        parts.append(f"data: {json.dumps(APIError(503, event[1]).body())}\n\n")
                        failed = True
                        break
                write_pending()
                yield "".join(parts)
            if include_usage and all(o is not None for o in outputs):
                yield chunk([], server.choices(outputs, chat)[1])
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client disconnected mid-stream: free its blocks now
            server.engine.abort(submission)
            raise
        finally:
            if None in outputs:  # ended early (a disconnect, an engine failure): free what it still holds
                server.engine.abort(submission)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_found(request: Request, path: str):
        server.check_auth(request.headers)
        raise APIError(404, f"no endpoint /{path}")

    return app


def prometheus_text(server: Server) -> str:
    """The engine's state in Prometheus' text format (prometheus_client renders it)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    state, registry = server.engine.state, CollectorRegistry()

    def gauge(name, text, value):
        Gauge(name, text, registry=registry).set(value)

    gauge("zoo_requests_running", "requests running in the engine", state["running"])
    gauge("zoo_requests_waiting", "requests waiting for the engine", state["waiting"])
    gauge("zoo_kv_blocks_used", "KV-cache blocks in use", state["kv_blocks_used"])
    gauge("zoo_kv_blocks_total", "KV-cache blocks", state["kv_blocks_total"])
    gauge("zoo_generated_tokens_total", "tokens generated since start", state["generated_tokens"])
    gauge("zoo_tokens_per_second", "tokens generated per second over the last 10 s", state["tokens_per_second"])
    gauge("zoo_tokens_per_request_step", "tokens committed per request per step (above 1: accepted drafts)",
          state["tokens_per_request_step"])
    return generate_latest(registry).decode()


# ---------------------------------------------------------------------------------------------- entry

def serve(cfg: DictConfig) -> int:
    from zoo.settings import check_settings

    try:
        check_settings(cfg, run=True, serve=True)
        import fastapi  # noqa: F401 - the serve extra
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"error: python -m zoo.serve needs the serve extra (pip install 'zoo-runtime[serve]'): {exc}",
              file=sys.stderr)
        return EXIT_BAD_SETTING
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTING
    engine, other_pipes = EngineClient.start(cfg)
    if engine.failure is not None:
        message, status = engine.failure
        print(f"error: {message}", file=sys.stderr)
        return status
    try:  # server.http_processes > 1: each binds the port with SO_REUSEPORT, this one first
        listener = listening_socket(cfg, shared=bool(other_pipes))
    except OSError as exc:
        print(f"error: cannot listen on {cfg.server.host}:{cfg.server.port}: {exc}", file=sys.stderr)
        for pipes in other_pipes:
            for pipe in pipes:
                pipe.close()
        engine.stop()
        return EXIT_BAD_SETTING
    cfg.server.port = listener.getsockname()[1]  # port 0: the one the system chose, for the others and the log
    others = []
    if other_pipes:
        import multiprocessing

        from omegaconf import OmegaConf

        context, config = multiprocessing.get_context("spawn"), OmegaConf.to_container(cfg, resolve=True)
        started = []
        for index, pipes in enumerate(other_pipes, 1):
            said, says = context.Pipe(duplex=False)  # "listening", or why not
            process = context.Process(target=http_process, args=(config, pipes, index, len(other_pipes) + 1, says),
                                      name=f"zoo-http-{index}", daemon=False)
            process.start()
            for pipe in pipes:
                pipe.close()  # the engine sees that process's end close when it stops or dies
            says.close()
            others.append(process)
            started.append(said)
        # this process serves only once the others listen too: the first clients spread over all of them
        failure = next((why for why in map(_started, others, started) if why is not None), None)
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr)
            for process in others:
                process.terminate()
                process.join(30)
            engine.stop()
            return 1
    status = run_http(cfg, engine, listener, others)
    print("zoo.serve stopped", file=sys.stderr)
    return status


def listening_socket(cfg: DictConfig, shared: bool):
    """The socket on server.host and server.port, bound before uvicorn starts so that a port in use is one line.
    ``shared``: one of several HTTP processes, each of which binds the port for itself (SO_REUSEPORT): Linux
    spreads new connections over their sockets by a hash of the connection's addresses, rather than to whichever
    process wakes first on one shared socket."""
    import socket

    if shared and not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("server.http_processes above 1 needs SO_REUSEPORT (Linux)")
    host = str(cfg.server.host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(cfg.server.port)), family=family, backlog=2048, reuse_port=shared)


def _started(process, said, timeout: float = 300) -> str | None:
    """None once ``process`` says it listens; else why it did not start."""
    try:
        if said.poll(timeout):
            message = said.recv()
            return None if message[0] == "listening" else f"{process.name} did not start: {message[1]}"
    except EOFError:
        process.join(5)
    return f"{process.name} did not start (exit status {process.exitcode})"


def http_process(config: dict, pipes: list, index: int, count: int, says) -> None:
    """HTTP process ``index`` of ``count`` (``server.http_processes``): the first one's sibling on the same port
    and engine. It says on ``says`` when it listens (or why it cannot), and stops with the first one (which passes
    its SIGTERM on) or when that one dies."""
    from multiprocessing import parent_process
    from multiprocessing.connection import wait

    from omegaconf import OmegaConf

    cfg = OmegaConf.create(config)
    engine = engine_of([EngineClient(pipe, index, count) for pipe in pipes])  # a pipe to each replica
    if engine.failure is not None:  # the engine failed after the first HTTP process saw it start
        says.send(("failed", engine.failure[0]))
        sys.exit(1)
    try:
        listener = listening_socket(cfg, shared=True)
    except OSError as exc:
        says.send(("failed", f"cannot listen on {cfg.server.host}:{cfg.server.port}: {exc}"))
        engine.stop()
        sys.exit(1)
    says.send(("listening",))

    def stop_with_the_first():
        wait([parent_process().sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_with_the_first, daemon=True).start()
    sys.exit(run_http(cfg, engine, listener, []))


def run_http(cfg: DictConfig, engine: EngineClient | EngineReplicas, listener, others: list) -> int:
    """Serves HTTP on the socket ``listener`` until SIGTERM or Ctrl-C, then finishes what runs within
    server.shutdown_timeout. ``others``: the other HTTP processes, which this one started: they get its SIGTERM,
    and one that dies stops the server."""
    import uvicorn

    server = Server(cfg, engine)
    config = uvicorn.Config(build_app(server), log_level="warning",
                            timeout_graceful_shutdown=int(cfg.server.shutdown_timeout))
    http = _uvicorn_server(config, others)
    if engine.index == 0:
        count = ", ".join(([f"{engine.count} HTTP processes"] if engine.count > 1 else [])
                          + ([f"{engine.replicas} engine replicas"] if engine.replicas > 1 else []))
        count = f" ({count})" if count else ""
        print(f"zoo serving {', '.join(server.model_names())} on http://{cfg.server.host}:{cfg.server.port}{count}"
              + (" (API key required)" if server.api_key else ""), file=sys.stderr, flush=True)
    failed = []
    if others:
        threading.Thread(target=_stop_if_one_dies, args=(others, http, failed), daemon=True).start()
    # uvicorn raises the signal again once it has shut down; this handler, which it restores first, takes it, so
    # that a SIGTERM ends in exit status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    status = 0
    try:
        http.run(sockets=[listener])
    except KeyboardInterrupt:
        status = 130
    finally:
        for process in others:
            process.join(int(cfg.server.shutdown_timeout) + 30)
            if process.is_alive():
                process.kill()
        engine.stop()  # aborts whatever is left and frees its blocks
        server.media_tmp.cleanup()
    return 1 if failed else status


def _uvicorn_server(config, others: list):
    """uvicorn's server, passing the signal that stops it (SIGTERM, Ctrl-C) on to ``others`` as SIGTERM, so that
    every HTTP process stops accepting and finishes its requests at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            for process in others:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)
            super().handle_exit(sig, frame)

    return Server(config)


def _stop_if_one_dies(others: list, http, failed: list) -> None:
    from multiprocessing.connection import wait

    ended = wait([process.sentinel for process in others])
    if not http.should_exit:  # it died on its own: the clients it held are cut off, so the server stops
        process = next(p for p in others if p.sentinel in ended)
        process.join()
        print(f"error: {process.name} stopped (exit status {process.exitcode}); stopping the server",
              file=sys.stderr, flush=True)
        failed.append(process.name)
        http.handle_exit(signal.SIGTERM, None)


def main() -> None:
    import hydra

    from zoo.config import CONFIG_MODULE, cli_main

    main_fn = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="serve", version_base=None)(
        lambda cfg: sys.exit(serve(cfg)))
    cli_main(main_fn, name="serve")


if __name__ == "__main__":
    main()
