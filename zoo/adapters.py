"""Adapters: per-request weights chosen by name, from PEFT folders.

``adapters`` in the config maps names to PEFT folders (``adapter_config.json``
plus ``adapter_model.safetensors``); a request selects one with its
``adapter`` field, and requests without one run on the base model in the same
batch. The folder's ``peft_type`` picks the plugin that serves it: a plugin
returns ``{"LORA": factory}`` from ``zoo_adapter_kinds`` and the factory
builds one :class:`AdapterKind` per engine, before the weights load.

The registry here owns what every kind shares: the names, reading folders,
refusing pickles, the prefix-cache key (blocks are never shared between
adapters, nor between two loads under one name), the request check, and how
many distinct adapters of a kind one step may hold.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.errors import RequestError, ZooError

CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"


def read_peft_folder(path) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """``(folder, adapter_config, tensors on the CPU)``; a ZooError names what is wrong."""
    from safetensors.torch import load_file

    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ZooError(f"{folder}: no such adapter folder")
    if not (folder / CONFIG_FILE).is_file():
        raise ZooError(f"{folder}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ZooError(f"{folder / CONFIG_FILE}: not readable JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        raise ZooError(f"{folder / CONFIG_FILE}: no peft_type")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / PICKLE_FILE).is_file():
            raise ZooError(f"{folder}: {PICKLE_FILE} is a pickle, which runs code when loaded; save the adapter "
                           f"with safe_serialization=True (peft's default) to get {WEIGHTS_FILE}")
        raise ZooError(f"{folder}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ZooError(f"{folder / WEIGHTS_FILE}: not readable ({type(exc).__name__}: {exc})") from None
    return folder, config, tensors


def describe_folder(path) -> str:
    """One line from a folder's ``adapter_config.json`` alone (no weights read): type, rank, targets."""
    folder = Path(str(path)).expanduser()
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable ({folder / CONFIG_FILE}: {type(exc).__name__})"
    kind = config.get("peft_type", "?")
    if kind == "LORA":
        targets = config.get("target_modules")
        targets = ", ".join(sorted(targets)) if isinstance(targets, list) else targets
        ranks = sorted({config.get("r")} | set((config.get("rank_pattern") or {}).values()), key=str)
        return (f"LORA r={'/'.join(map(str, ranks))}, alpha {config.get('lora_alpha')}"
                f"{', rslora' if config.get('use_rslora') else ''}, targets {targets}")
    if kind == "PROMPT_TUNING":
        return f"PROMPT_TUNING {config.get('num_virtual_tokens')} virtual tokens"
    return kind


class AdapterKind:
    """What a plugin does for one PEFT type. Built once per engine, before the weights load; the
    registry registers it as a plugin too, so its hook implementations run like any plugin's."""

    peft_type = ""
    max_per_step: int | None = None  # distinct adapters of this kind one step may hold (None: any)

    def load(self, name: str, folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
        """Check and keep an adapter; returns its one-line description (rank, targets...)."""
        raise NotImplementedError

    def unload(self, name: str) -> None:
        raise NotImplementedError


@dataclass
class Adapter:
    name: str
    kind: AdapterKind
    folder: Path
    description: str
    generation: int  # a new load under an old name gets a new cache key


class Adapters:
    """The run's adapters by name, and the kinds that serve them."""

    def __init__(self, plugin_manager, engine):
        from zoo.plugins import registered_names

        registry = registered_names(plugin_manager.hook.zoo_adapter_kinds, "adapter kind")
        self.kinds: dict[str, AdapterKind] = {}
        for peft_type, (_, factory) in registry.items():
            kind = factory(engine)
            self.kinds[peft_type] = kind
            if not plugin_manager.is_registered(kind):
                plugin_manager.register(kind, name=f"adapter kind {peft_type}")
        self.engine = engine
        self.entries: dict[str, Adapter] = {}
        self.failed: dict[str, str] = {}  # name -> why it did not load (its requests fail with this)
        self.generations = 0
        configured = engine.config.get("adapters") or {}
        for name in configured:
            try:
                self.add(str(name), configured[name])
            except ZooError as exc:  # a bad adapter fails the requests that name it, not the run
                self.failed[str(name)] = str(exc)
                print(f"warning: adapter {name!r} not loaded: {exc}", file=sys.stderr)

    def add(self, name: str, path) -> Adapter:
        if not isinstance(name, str) or not name:
            raise ZooError(f"an adapter name must be a non-empty string, not {name!r}")
        if name in self.entries:
            raise ZooError(f"adapter {name!r} is loaded already; remove it first")
        folder, config, tensors = read_peft_folder(path)
        peft_type = config["peft_type"]
        kind = self.kinds.get(peft_type)
        if kind is None:
            raise ZooError(f"{folder}: peft_type {peft_type} is not served (served: "
                           f"{', '.join(sorted(self.kinds)) or 'none'})")
        description = kind.load(name, folder, config, tensors)
        self.generations += 1
        self.entries[name] = Adapter(name, kind, folder, description, self.generations)
        self.failed.pop(name, None)
        return self.entries[name]

    def remove(self, name: str) -> None:
        """Unload an adapter; refused while a request that names it is waiting or running."""
        if name not in self.entries:
            raise ZooError(f"no adapter {name!r} is loaded (loaded: {', '.join(sorted(self.entries)) or 'none'})")
        scheduler = self.engine.scheduler
        users = sum(1 for r in [*scheduler.waiting, *scheduler.running] if r.extras.get("adapter") == name)
        if users:
            raise ZooError(f"adapter {name!r} is in use by {users} unfinished request(s)")
        self.entries.pop(name).kind.unload(name)

    def of(self, request) -> Adapter | None:
        """The adapter a request names (checked at intake), or None for the base model."""
        name = request.extras.get("adapter")
        return None if name is None else self.entries.get(name)

    def name_for(self, request, kind: AdapterKind) -> str | None:
        """The request's adapter name if ``kind`` serves it, else None (the base model or another kind)."""
        adapter = self.of(request)
        return adapter.name if adapter is not None and adapter.kind is kind else None

    def check(self, request) -> None:
        name = request.extras.get("adapter")
        if name is None or name in self.entries or not self.kinds:  # no kinds: a third-party plugin's field
            return
        if name in self.failed:
            raise RequestError(f"adapter {name!r} could not be loaded: {self.failed[name]}")
        raise RequestError(f"unknown adapter {name!r} (loaded: {', '.join(sorted(self.entries)) or 'none'})")

    def cache_key(self, request):
        adapter = self.of(request)
        return None if adapter is None else ("adapter", adapter.name, adapter.generation)

    def step_resource(self, request):
        """For the scheduler: ``(kind, name, max_per_step)`` when the request's adapter kind limits the
        distinct adapters of a step (LoRA's device slots), else None."""
        adapter = self.of(request)
        if adapter is None or adapter.kind.max_per_step is None:
            return None
        return adapter.kind.peft_type, adapter.name, adapter.kind.max_per_step

    def lines(self) -> list[str]:
        return [f"adapter {a.name}: {a.description} ({a.folder})" for a in self.entries.values()]
