"""Prompt tuning from PEFT folders: learned virtual tokens before the prompt.

A PEFT ``PROMPT_TUNING`` adapter holds ``prompt_embeddings``
``[num_virtual_tokens, hidden]``. A request naming one gets ids
``vocab_size .. vocab_size + n - 1`` prepended to its prompt, which is what
peft does: the virtual tokens take the first positions, count against
``max_model_len`` and key the prefix cache (with the adapter, through the
registry). Following TensorRT-LLM's prompt table, an id ``vocab_size + i``
anywhere in a request's ``prompt_ids`` is row ``i`` of its adapter's table, so
a prompt that already holds such ids places its virtual tokens itself and
gets nothing prepended. ``zoo_embed_modify`` writes the rows into the step's
embeddings.
"""

from __future__ import annotations

import torch

from zoo import RequestError, Scope, ZooError, hookimpl
from zoo.adapters import AdapterKind
from zoo.step import BufferSpec

zoo_scope = Scope(config_key="adapters")
TABLE_ROW = "prompt_table_row"  # per token: its row in the stacked tables of every loaded adapter, -1 for none


class PromptTuning(AdapterKind):
    peft_type = "PROMPT_TUNING"

    def __init__(self, engine):
        self.engine = engine
        self.tables: dict[str, torch.Tensor] = {}  # adapter -> [n, hidden] on the device
        self.offsets: dict[str, int] = {}
        self.stacked = None
        self.step_has_rows = False

    def load(self, name, folder, config, tensors) -> str:
        desc = self.engine.description
        table = tensors.get("prompt_embeddings")
        if table is None or table.dim() != 2:
            raise ZooError(f"{folder}: no prompt_embeddings matrix (a PEFT prompt-tuning adapter has one)")
        if int(config.get("num_transformer_submodules") or 1) != 1:
            raise ZooError(f"{folder}: num_transformer_submodules={config['num_transformer_submodules']}: only "
                           "decoder-only models' prompt tuning (1) is supported")
        if table.shape[1] != desc.hidden_size:
            raise ZooError(f"{folder}: prompt_embeddings have width {table.shape[1]}, this model's hidden size is "
                           f"{desc.hidden_size}: an adapter made for another base")
        self.tables[name] = table.to(self.engine.device, self.engine.dtype)
        self._stack()
        return f"PROMPT_TUNING {table.shape[0]} virtual tokens"

    def unload(self, name: str) -> None:
        self.tables.pop(name, None)
        self._stack()

    def _stack(self) -> None:
        self.offsets, start = {}, 0
        for name, table in self.tables.items():
            self.offsets[name], start = start, start + table.shape[0]
        self.stacked = torch.cat(list(self.tables.values())) if self.tables else None

    # ------------------------------------------------------------------ requests

    @hookimpl
    def zoo_request_table_size(self, request):
        name = self.engine.adapters.name_for(request, self)
        return None if name is None else self.tables[name].shape[0]

    @hookimpl
    def zoo_prompt_transform(self, request):
        name = self.engine.adapters.name_for(request, self)
        if name is None:
            return
        vocab = self.engine.description.vocab_size
        if not any(t >= vocab for t in request.prompt_token_ids):
            request.prompt_token_ids = [vocab + i for i in range(self.tables[name].shape[0])] + request.prompt_token_ids
        elif request.prompt_token_ids[-1] >= vocab:
            # The last prompt token may be computed alone in a decode-shaped step, which replays as a CUDA
            # graph that writes no table rows.
            raise RequestError("a prompt's last token must be a vocabulary token, not a virtual one")

    # ------------------------------------------------------------------ steps

    @hookimpl
    def zoo_engine_start(self, setup):
        setup.add_buffer(BufferSpec(TABLE_ROW, (setup.limits.max_num_tokens,), fill=-1))
        # a prompt graph writes no table rows: prompt steps of a request with an adapter run eagerly
        setup.run_eagerly_when(lambda scheduled: any(
            e.start < len(e.request.prompt_token_ids) and self.engine.adapters.name_for(e.request, self)
            for e in scheduled))

    @hookimpl
    def zoo_step_prepare(self, batch, buffers):
        self.step_has_rows = False
        if not self.tables:
            return
        vocab, rows = self.engine.description.vocab_size, [-1] * batch.num_tokens
        for entry, offset in zip(batch.scheduled, batch.token_offsets):
            name = self.engine.adapters.name_for(entry.request, self)
            if name is None or entry.start >= len(entry.request.prompt_token_ids):
                continue  # virtual tokens sit in prompts only
            for j in range(entry.num_tokens):
                token = entry.request.token_at(entry.start + j)
                if token >= vocab:
                    rows[offset + j] = self.offsets[name] + token - vocab
        self.step_has_rows = any(r >= 0 for r in rows)
        if self.step_has_rows:
            buffers[TABLE_ROW].copy_(torch.tensor(rows))

    @hookimpl
    def zoo_embed_modify(self, hidden, context, model):
        if context.batch is None or not self.step_has_rows:
            return  # graph replays (decode-shaped steps) and steps without virtual tokens
        rows = context.buffers[TABLE_ROW]
        virtual = rows >= 0
        # The row replaces the token embedding that stood in for it; whatever else the embeddings hold
        # (GPT-2's learned positions) stays, as it does for peft's inputs_embeds.
        # The model's own rule for it (under tensor parallelism the stand-in is zero: no rank holds the id).
        stand_in = model.token_embeddings(context.buffers["input_ids"][virtual])
        hidden[virtual] += self.stacked[rows[virtual]].to(hidden.dtype) - stand_in


@hookimpl
def zoo_adapter_kinds():
    return {"PROMPT_TUNING": PromptTuning}


@hookimpl
def zoo_request_fields():
    return ["adapter"]
