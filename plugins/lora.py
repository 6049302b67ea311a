"""LoRA adapters from PEFT folders, many in one batch.

Each projection an adapter targets is wrapped (``zoo.model.LinearWrapper``, so
q/k/v and gate/up stay fused for the base path) with two matrices holding every
device slot side by side: ``shrink`` ``[in, slots * rank]`` and ``expand``
``[slots * rank, out]``, each adapter's A and its scaled B in its slot's
columns, zero-padded to ``runtime.max_lora_rank``. A step computes
``((x @ shrink) * columns) @ expand``, where ``columns`` keeps, for every
token, only its own adapter's columns (none for a base request): eight
adapters in one step cost one pass, the Punica/S-LoRA idea in two dense
products, and the buffers are static, so decode steps stay CUDA graphs. A step
with no LoRA request skips the products: eagerly, and under CUDA graphs by
replaying the plain graphs (the products are captured in a ``lora`` variant).

``runtime.max_loras`` adapters sit in device slots and ``runtime.max_cpu_loras``
in host memory (LRU; an evicted adapter is read again from its folder); the
scheduler never puts more distinct adapters in one step than there are slots.

PEFT's format: ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``, ``lora_alpha`` (``alpha_pattern``),
``use_rslora``; each module's rank is its tensors' (``rank_pattern``).
Module names are the checkpoint's: the architecture plugin's weight converter
maps them onto zoo's projections (GPT-2's ``c_attn`` becomes q, k and v), so
an adapter for any architecture zoo loads applies where its base layer went.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path

import torch

from zoo import Scope, ZooError, hookimpl
from zoo.adapters import AdapterKind, read_peft_folder
from zoo.forward_context import get_forward_context
from zoo.model import LinearWrapper
from zoo.parallel import shard_of
from zoo.step import BufferSpec

zoo_scope = Scope(config_key="adapters")
COLUMNS = "lora_columns"  # per token: 1 on its adapter's slot columns, 0 elsewhere
VARIANT = "lora"  # the decode and verify graphs that compute the products; the plain ones skip them
PREFIX = "base_model.model."
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_ZOO_MODULE = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(p) for p in PROJECTIONS) + r")")


class LoRAProjection(LinearWrapper):
    def __init__(self, base_layer, kind: "LoRA", slots: int, rank: int):
        super().__init__(base_layer)
        self.kind = kind
        weight = base_layer.weight
        self.register_buffer("shrink", weight.new_zeros(weight.shape[1], slots * rank), persistent=False)
        self.register_buffer("expand", weight.new_zeros(slots * rank, weight.shape[0]), persistent=False)

    def delta(self, x: torch.Tensor):
        context = get_forward_context()
        columns = context.buffers.get(COLUMNS)
        wanted = context.graph_variant == VARIANT if context.batch is None else self.kind.step_has_lora
        if columns is None or not wanted:
            return 0  # base requests only (an eager step or the plain graphs), or a pass outside the steps
        return ((x @ self.shrink) * columns) @ self.expand


class LoRA(AdapterKind):
    peft_type = "LORA"

    def __init__(self, engine):
        runtime, self.engine = engine.config["runtime"], engine
        self.max_per_step = int(runtime["max_loras"])
        self.max_rank, self.max_cpu = int(runtime["max_lora_rank"]), int(runtime["max_cpu_loras"])
        if self.max_per_step < 1 or self.max_rank < 1 or self.max_cpu < 1:
            raise ZooError("runtime.max_loras, runtime.max_lora_rank and runtime.max_cpu_loras must be >= 1")
        self.folders: dict[str, Path] = {}
        self.targets: dict[str, set[str]] = {}  # adapter -> zoo module paths it changes
        self.cpu: OrderedDict[str, dict] = OrderedDict()  # adapter -> {zoo path: (A [r, in], scaled B [out, r])}
        self.slots: list[str | None] = [None] * self.max_per_step
        self.slot_use: list[int] = [0] * self.max_per_step  # step counter at last use, for LRU eviction
        self.wrappers: dict[str, LoRAProjection] = {}
        self.model_modified = False  # projections are wrapped once, for the adapters loaded at start
        self.steps, self.step_has_lora = 0, False
        self.loads = 0  # adapters copied into a device slot (reloads after eviction included)

    # ------------------------------------------------------------------ reading adapters

    def load(self, name, folder, config, tensors) -> str:
        weights, ranks = self._parse(folder, config, tensors)
        if self.model_modified and not set(weights) <= set(self.wrappers):
            missing = sorted(set(weights) - set(self.wrappers))
            raise ZooError(f"{folder}: adapter {name!r} changes {', '.join(missing[:3])}, which no adapter loaded at "
                           "start targets; start the engine with an adapter on those projections")
        self.folders[name], self.targets[name] = Path(folder), set(weights)
        self._keep_on_cpu(name, weights)
        modules = sorted({path.split(".", 3)[3] for path in weights})
        rank = f"r={min(ranks)}" if min(ranks) == max(ranks) else f"r={min(ranks)}..{max(ranks)}"
        return (f"LORA {rank}, alpha {config.get('lora_alpha', 8)}{', rslora' if config.get('use_rslora') else ''}, "
                f"targets {', '.join(m.split('.')[-1] for m in modules)}")

    def _parse(self, folder, config, tensors) -> tuple[dict, list[int]]:
        if config.get("modules_to_save"):
            raise ZooError(f"{folder}: modules_to_save {config['modules_to_save']} (whole trained copies of modules) "
                           "is not supported; only LoRA's low-rank matrices are")
        if config.get("use_dora"):
            raise ZooError(f"{folder}: DoRA (use_dora) is not supported")
        desc = self.engine.description
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
            if match is None:
                raise ZooError(f"{folder}: tensor {key} is not a LoRA A or B matrix of a linear layer")
            pairs.setdefault(match.group(1), {})[match.group(2)] = value
        if not pairs:
            raise ZooError(f"{folder}: the adapter holds no LoRA matrices")
        alpha, patterns = float(config.get("lora_alpha", 8)), config.get("alpha_pattern") or {}
        weights, ranks = {}, []
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise ZooError(f"{folder}: module {module} has lora_{'B' if 'A' in ab else 'A'} missing")
            a, b = ab["A"].float(), ab["B"].float()
            rank = a.shape[0]
            if b.shape[1] != rank:
                raise ZooError(f"{folder}: module {module}: lora_A has rank {rank}, lora_B {b.shape[1]}")
            if rank > self.max_rank:
                raise ZooError(f"{folder}: module {module} has rank {rank}, above runtime.max_lora_rank="
                               f"{self.max_rank}; raise it")
            ranks.append(rank)
            module_alpha = next((float(v) for p, v in patterns.items() if re.fullmatch(rf"(.*\.)?{p}", module)), alpha)
            scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
            for path, rows in self._zoo_modules(folder, module, b.shape[0]):
                expected_in, expected_out = _projection_shape(desc, path)
                if a.shape[1] != expected_in or len(rows) != expected_out:
                    raise ZooError(f"{folder}: module {module} maps [{a.shape[1]} -> {b.shape[0]}], but this model's "
                                   f"{path} is [{expected_in} -> {expected_out}]: an adapter made for another base")
                weights[path] = (a, b[rows] * scale)
        return weights, ranks

    def _zoo_modules(self, folder, module: str, out_rows: int) -> list[tuple[str, torch.Tensor]]:
        """zoo's projections a checkpoint module's output rows went to: the architecture's weight converter
        applied to an index vector under the module's bias name, which it splits as it split the layer."""
        hooks, desc = self.engine.hooks, self.engine.description
        probe = torch.arange(out_rows)
        converted = hooks.zoo_weights_convert(description=desc, name=f"{module}.bias", tensor=probe)
        found = [(zoo_name.removesuffix(".bias"), rows.long())
                 for zoo_name, rows in (converted if converted is not None else [(f"{module}.bias", probe)])]
        matches = [_ZOO_MODULE.fullmatch(path) for path, _ in found]
        if not found or any(m is None or int(m.group(1)) >= desc.num_layers for m in matches):
            raise ZooError(f"{folder}: target module {module} is not an attention or MLP projection of this "
                           f"{desc.architecture} model (LoRA applies to q/k/v/o and gate/up/down projections)")
        return found

    def _keep_on_cpu(self, name: str, weights: dict) -> None:
        self.cpu[name] = weights
        self.cpu.move_to_end(name)
        while len(self.cpu) > self.max_cpu:
            self.cpu.popitem(last=False)

    def _weights(self, name: str) -> dict:
        if name not in self.cpu:  # evicted from host memory: read the folder again
            folder, config, tensors = read_peft_folder(self.folders[name])
            self._keep_on_cpu(name, self._parse(folder, config, tensors)[0])
        self.cpu.move_to_end(name)
        return self.cpu[name]

    def unload(self, name: str) -> None:
        self.folders.pop(name, None)
        self.targets.pop(name, None)
        self.cpu.pop(name, None)
        if name in self.slots:
            self.slots[self.slots.index(name)] = None

    # ------------------------------------------------------------------ the model and the step

    @hookimpl
    def zoo_model_modify(self, model):
        wanted = set().union(*self.targets.values()) if self.targets else set()
        for path in sorted(wanted):
            parent_path, attr = path.rsplit(".", 1)
            parent = model.get_submodule(parent_path)
            wrapper = LoRAProjection(getattr(parent, attr), self, self.max_per_step, self.max_rank)
            setattr(parent, attr, wrapper)
            self.wrappers[path] = wrapper
        self.model_modified = True

    @hookimpl
    def zoo_engine_start(self, setup):
        setup.add_buffer(BufferSpec(COLUMNS, (setup.limits.max_num_tokens, self.max_per_step * self.max_rank),
                                    dtype=self.engine.dtype))
        if self.wrappers:
            adapters = self.engine.adapters
            setup.add_graph_variant(VARIANT, lambda scheduled: any(adapters.name_for(e.request, self) for e in scheduled))

    @hookimpl
    def zoo_step_prepare(self, batch, buffers):
        self.steps += 1
        names = [self.engine.adapters.name_for(e.request, self) for e in batch.scheduled]
        self.step_has_lora = any(names)
        if not self.step_has_lora:
            return  # such a step skips the products (eagerly, or in the plain graphs): the columns go unread
        slot_of = {name: self._slot(name, set(names)) for name in dict.fromkeys(n for n in names if n)}
        slots = torch.tensor(batch.per_token([slot_of[n] if n else -1 for n in names], fill=-1))
        column_slot = torch.arange(self.max_per_step * self.max_rank) // self.max_rank
        buffers[COLUMNS].copy_((slots[:, None] == column_slot[None, :]).to(buffers[COLUMNS].dtype))

    def _slot(self, name: str, in_step: set) -> int:
        if name in self.slots:
            slot = self.slots.index(name)
        else:  # a free slot, else the least recently used one that this step does not need
            free = [s for s, held in enumerate(self.slots) if held is None or held not in in_step]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_use[s]))
            self._write_slot(slot, name)
        self.slot_use[slot] = self.steps
        return slot

    @torch.no_grad()
    def _write_slot(self, slot: int, name: str) -> None:
        weights, r = self._weights(name), self.max_rank
        columns = slice(slot * r, (slot + 1) * r)
        for path, wrapper in self.wrappers.items():
            wrapper.shrink[:, columns] = 0
            wrapper.expand[columns] = 0
            if path in weights:
                a, b = self._rank_part(path, *weights[path])
                wrapper.shrink[:, slot * r:slot * r + a.shape[0]] = a.t().to(wrapper.shrink)
                wrapper.expand[slot * r:slot * r + a.shape[0]] = b.t().to(wrapper.expand)
        self.slots[slot] = name
        self.loads += 1


    def _rank_part(self, path: str, a: torch.Tensor, b: torch.Tensor):
        """Under tensor parallelism, the part of A [r, in] and B [out, r] this rank's slice of the projection
        needs: B's rows of a layer split by outputs, A's columns of one split by inputs (whose partial product
        the layer's all-reduce sums with the base layer's)."""
        parallel = self.engine.parallel
        rule = shard_of(f"{path}.weight", self.engine.description, parallel) if parallel else None
        if rule is None or rule == "zeros":
            return a, b
        dim, first, length = rule
        return (a, b[first:first + length]) if dim == 0 else (a[:, first:first + length], b)


def _projection_shape(desc, path: str) -> tuple[int, int]:
    """(in, out) features of one of zoo's projections."""
    q, kv = desc.num_heads * desc.head_dim, desc.num_kv_heads * desc.head_dim
    name = path.rsplit(".", 1)[1]
    return {"q_proj": (desc.hidden_size, q), "k_proj": (desc.hidden_size, kv), "v_proj": (desc.hidden_size, kv),
            "o_proj": (q, desc.hidden_size), "gate_proj": (desc.hidden_size, desc.intermediate_size),
            "up_proj": (desc.hidden_size, desc.intermediate_size),
            "down_proj": (desc.intermediate_size, desc.hidden_size)}[name]


@hookimpl
def zoo_adapter_kinds():
    return {"LORA": LoRA}


@hookimpl
def zoo_request_fields():
    return ["adapter"]
