"""Every run setting's type, range and choices, in one place, checked before any work starts.

``check_settings(config)`` runs when an engine starts (the CLI and ``zoo.LLM``
alike) and before ``zoo.run`` reads its input: a bad value is one
``ZooError`` naming the key, the value and what is allowed, and a key that
no schema here or in ``conf/`` knows is an error suggesting the nearest
known one, so a misspelt setting is never silently ignored. The README's
tables list the same keys; ``python -m zoo.run --cfg job`` shows a run's
values.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from zoo.errors import ZooError


@dataclass(frozen=True)
class Setting:
    kind: type | tuple  # int, float, bool, str; (str, None) for an optional string
    low: float | None = None  # inclusive bounds for numbers
    high: float | None = None
    choices: tuple = ()  # allowed values for strings
    optional: bool = False  # null allowed
    positive: bool = False  # numbers: above zero
    text: str = ""  # what is allowed, where a rule checks more than the type (runtime.device)

    def check(self, key: str, value: Any) -> None:
        if value is None:
            if self.optional:
                return
            raise ZooError(f"{key}=null: a value is required ({self.describe()})")
        kind = self.kind
        ok = (isinstance(value, bool) if kind is bool
              else isinstance(value, int) and not isinstance(value, bool) if kind is int
              else isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
              else isinstance(value, str))
        if not ok or (self.choices and value not in self.choices) or (
                self.low is not None and value < self.low) or (self.high is not None and value > self.high) or (
                self.positive and value <= 0):
            raise ZooError(f"{key}={value!r}: must be {self.describe()}")

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.choices:
            text = "one of " + ", ".join(map(str, self.choices))
        else:
            text = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[self.kind]
            if self.low is not None and self.high is not None:
                text += f" in [{self.low}, {self.high}]"
            elif self.low is not None:
                text += f" >= {self.low}"
            elif self.positive:
                text += " > 0"
        return text + (" or null" if self.optional else "")


DTYPES = ("auto", "float32", "float16", "bfloat16")
RUNTIME = {
    "device": Setting(str, text="auto, cpu, cuda or cuda:N (checked against the machine)"),
    "dtype": Setting(str, choices=DTYPES),
    "block_size": Setting(int, 1, 4096),
    "num_kv_blocks": Setting(int, 1, optional=True),
    "cpu_kv_cache_gb": Setting(float, positive=True),
    "cpu_keep_freed_memory": Setting(bool),
    "gpu_memory_utilization": Setting(float, 0.01, 1.0),
    "max_num_seqs": Setting(int, 1),
    "max_num_batched_tokens": Setting(int, 1),
    "max_model_len": Setting(int, 2, optional=True),
    "sliding_window": Setting(int, 1, optional=True),
    "attention_sinks": Setting(int, 0),
    "enable_prefix_caching": Setting(bool),
    "attention_backend": Setting(str, choices=("auto", "sdpa", "triton")),
    "cuda_graphs": Setting(bool),
    "prompt_graph_tokens": Setting(int, 0),
    "mixed_graph_tokens": Setting(int, 0),
    "fused_ops": Setting(bool),
    "enforce_eager": Setting(bool),
    "overlap_steps": Setting(bool),
    "admission_interval": Setting(int, 1),
    "tensor_parallel_size": Setting(int, 1),
    "seed": Setting(int, 0),
    "max_loras": Setting(int, 1),
    "max_lora_rank": Setting(int, 1),
    "max_cpu_loras": Setting(int, 1),
}
RUN = {  # zoo.run's own keys
    "prompt": Setting(str, optional=True),
    "input.file": Setting(str, optional=True),
    "input.resume": Setting(bool),
    "output.format": Setting(str, choices=("text", "jsonl")),
    "output.file": Setting(str, optional=True),
    "output.progress": Setting(str, choices=("auto", "on", "off")),
    "output.stream": Setting(bool),
    "output.sweep_table": Setting(str, optional=True),
}
SERVE = {  # zoo.serve's own keys
    "server.host": Setting(str),
    "server.port": Setting(int, 0, 65535),
    "server.api_key": Setting(str, optional=True),
    "server.served_model_name": Setting(str, optional=True),
    "server.max_body_bytes": Setting(int, 1),
    "server.max_prompt_tokens": Setting(int, 1, optional=True),
    "server.max_waiting_requests": Setting(int, 1),
    "server.shutdown_timeout": Setting(int, 0),
    "server.allowed_media_dir": Setting(str, optional=True),
    "server.engine_threads": Setting(int, 1, optional=True),
    "server.stream_interval": Setting(int, 1),
    "server.http_processes": Setting(int, 1),
    "server.data_parallel_size": Setting(int, 1),
}
# Top-level keys of the run config; groups own their keys (decoding and processor options are plugins').
TOP_LEVEL = {"model", "decoding", "runtime", "processor", "experiment", "prompt", "input", "output", "sampling",
             "plugins", "adapters", "hydra", "server"}


def _unknown(key: str, known) -> ZooError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in known], n=1)
    hint = f" (did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}?)" if close else ""
    return ZooError(f"{key}: no such setting{hint}")


def suggest(key: str, config) -> str:
    """The error for an unknown dotted ``key``, with the nearest key its section of ``config`` has."""
    from omegaconf import OmegaConf

    section, _, _ = key.rpartition(".")
    node = OmegaConf.select(config, section) if section else config
    known = [f"{section}.{k}" if section else str(k) for k in (node.keys() if hasattr(node, "keys") else [])]
    return str(_unknown(key, known)) + f"; a new key needs +{key}=..."


def check_device(name: str) -> None:
    import torch

    if name in ("auto", "cpu"):
        return
    if not (name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ZooError(f"runtime.device={name!r}: must be auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ZooError(f"runtime.device={name}: this machine has no CUDA device (torch {torch.__version__}); "
                       "use runtime.device=cpu or auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ZooError(f"runtime.device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_replicas(replicas: int, runtime) -> None:
    """``server.data_parallel_size``: engine replicas, each a whole copy of the model; on CUDA a device each."""
    if replicas == 1:
        return
    if int(runtime.get("tensor_parallel_size") or 1) > 1:
        raise ZooError(f"server.data_parallel_size={replicas} with runtime.tensor_parallel_size="
                       f"{runtime.get('tensor_parallel_size')}: replicas of a tensor-parallel engine are not "
                       "supported; set one of them to 1")
    device = str(runtime.get("device", "auto"))
    import torch

    if device != "cpu" and torch.cuda.is_available():
        if device.startswith("cuda:"):
            raise ZooError(f"server.data_parallel_size={replicas} with runtime.device={device}: each replica takes a "
                           "device of its own (cuda:0, cuda:1, ...); use runtime.device=cuda")
        if torch.cuda.device_count() < replicas:
            raise ZooError(f"server.data_parallel_size={replicas}: each replica needs a CUDA device of its own and "
                           f"this machine has {torch.cuda.device_count()}; on one GPU raise runtime.max_num_seqs "
                           "instead, or serve from the CPU (runtime.device=cpu)")


def check_settings(config, run: bool = False, serve: bool = False) -> None:
    """``runtime.*`` (and, for ``zoo.run``, its input, output and top-level keys): types, ranges, choices, and
    no unknown key. ``sampling.*`` keys are checked by name here and by value per request."""
    runtime = config.get("runtime") or {}
    for key in runtime:
        if key not in RUNTIME:
            raise _unknown(f"runtime.{key}", RUNTIME)
    for key, setting in RUNTIME.items():
        if key in runtime:
            setting.check(f"runtime.{key}", runtime[key])
    check_device(runtime.get("device", "auto"))
    if run:
        for key in config:
            if key not in TOP_LEVEL:
                raise _unknown(str(key), TOP_LEVEL)
        for section in ("input", "output"):
            for key in config.get(section) or {}:
                if f"{section}.{key}" not in RUN:
                    raise _unknown(f"{section}.{key}", [k for k in RUN if k.startswith(section)])
        for key, setting in RUN.items():
            section, _, name = key.rpartition(".")
            node = config.get(section) if section else config
            if node is not None and name in node:
                setting.check(key, node[name])
    if serve:
        for key in config.get("server") or {}:
            if f"server.{key}" not in SERVE:
                raise _unknown(f"server.{key}", SERVE)
        for key, setting in SERVE.items():
            name = key.split(".", 1)[1]
            if name in (config.get("server") or {}):
                setting.check(key, config["server"][name])
        check_replicas(int((config.get("server") or {}).get("data_parallel_size") or 1), runtime)
    from dataclasses import fields

    from zoo.sampling_params import SamplingParams

    sampling_keys = {f.name for f in fields(SamplingParams)}
    for key in config.get("sampling") or {}:
        if key not in sampling_keys:
            raise _unknown(f"sampling.{key}", sampling_keys)


def settings_help(config) -> str:
    """``python -m zoo.run --help``: every checked key with its value in ``config`` and what it allows."""
    lines = ["python -m zoo.run [GROUP=OPTION] [KEY=VALUE] ... (Hydra overrides; -m sweeps; --cfg job prints the config)",
             "", "groups: model, decoding, processor, experiment (python -m zoo.plugins lists the plugins)", "",
             "settings (checked before anything loads):"]
    rows = [(f"runtime.{k}", (config.get("runtime") or {}).get(k), v) for k, v in RUNTIME.items()]
    for key, setting in RUN.items():
        section, _, name = key.rpartition(".")
        node = config.get(section) if section else config
        rows.append((key, node.get(name) if node is not None else None, setting))
    width = max(len(k) for k, _, _ in rows)
    lines += [f"  {key:<{width}}  = {value!s:<10}  {setting.describe()}" for key, value, setting in rows]
    lines += ["", "sampling.* (defaults for every request; JSONL records may override): "
              + ", ".join(str(k) for k in (config.get("sampling") or {})),
              "", "exit status: 0 all requests succeeded, 2 bad setting/input/model, 3 some requests failed, "
              "130 Ctrl-C, 143 SIGTERM"]
    return "\n".join(lines)
