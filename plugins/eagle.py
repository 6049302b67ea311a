"""EAGLE (Li et al. 2024): a one-layer draft model over the target's features, with an EAGLE-2 dynamic tree.

The draft reads pairs (target feature at position ``j``, token ``j + 1``):
``fc([embed(token); feature])`` through one Llama decoder layer (no input
norm), and the target's LM head on its output predicts the token after. Its
K/V live in a KV-cache layer of zoo's block pool (``setup.add_kv_layers``):
after every target step the pairs of the positions the step kept are run
through it ("extend"), so the draft cache follows the target's, through
chunked prefill, preemption and prefix caching. Drafting then grows a tree
from the last committed token: each of ``depth`` passes expands the
``top_k`` best nodes so far by their ``top_k`` likeliest tokens; the
``total_tokens - 1`` nodes with the highest cumulative draft log-probability
become the draft block. Speculative nodes keep their K/V in the request's
slots after its last token (the verify step lays its block there later).

``decoding.heads=DIR`` loads the released EAGLE-1/2 layout from safetensors:
``config.json`` (Llama fields, ``bias``) and ``model.safetensors`` with
``fc.weight``, ``fc.bias``, ``layers.0.self_attn.*``, ``layers.0.mlp.*``,
``layers.0.post_attention_layernorm.weight``. Without it the draft starts
from random weights: tokens stay exact, nothing is accepted.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

from zoo import DecodingMethod, DraftBlock, HeadsTrainer, Scope, ZooError, hookimpl
from zoo.forward_context import ForwardContext, forward_context
from zoo.decoding import heads_folder
from zoo.loader import load_module_weights
from zoo.model import MLP, Attention, DecoderLayer, DenseCausal, RMSNorm
from zoo.parallel import split_module, summed
from zoo.step import BufferSpec
from zoo.step_inputs import StepLayout, padded_rows

zoo_scope = Scope(option="decoding=eagle")
WEIGHTS = "model.safetensors"
EXTEND, GROW = "eagle_extend", "eagle_grow"  # following the target's cache; growing a tree (graph families)
TARGET_FEATURES, DRAFT_FEATURES = "eagle_target_features", "eagle_draft_features"  # what each draft pass reads
ROOT_FEATURES, NUM_TOKENS = "eagle_root_features", "eagle_num_tokens"  # per request, where a tree grows from


class EagleDraft(nn.Module):
    """EAGLE-1/2: ``fc([embed; feature])`` through one decoder layer without an input norm."""

    def __init__(self, desc, bias: bool):
        super().__init__()
        self.fc = nn.Linear(2 * desc.hidden_size, desc.hidden_size, bias=bias)
        self.layer = DecoderLayer(desc)
        self.layer.input_layernorm = nn.Identity()  # EAGLE's draft layer reads fc's output as it is

    @property
    def attention(self) -> nn.Module:
        return self.layer.self_attn

    def forward(self, embeds, features, rope):
        mlp_out, residual = self.layer(self.fc(torch.cat([embeds, features], dim=-1)), None, rope)
        return mlp_out + residual

    def top_k(self, outputs, k: int, target_logits):
        """(target token ids, log-probabilities) of the ``k`` likeliest next tokens after each output;
        ``target_logits``: the target's LM head (``DecoderModel.compute_logits``, whole under tensor parallelism)."""
        return torch.log_softmax(target_logits(outputs), dim=-1).topk(k, dim=-1)


class Eagle3Draft(nn.Module):
    """EAGLE-3: three target layers' features through ``fc``; the layer attends over [norm(embed); norm(feature)];
    its own head over a reduced vocabulary, mapped to the target's by ``d2t`` (target id = id + d2t[id])."""

    def __init__(self, desc, target_hidden: int, draft_vocab: int):
        super().__init__()
        hidden = desc.hidden_size
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = Attention(desc)
        for name in ("q_proj", "k_proj", "v_proj"):  # they read the embedding and the feature side by side
            old = getattr(self.midlayer.self_attn, name)
            setattr(self.midlayer.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.midlayer.mlp = MLP(desc)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self.midlayer, name, RMSNorm(hidden, desc.norm_eps))
        self.norm = RMSNorm(hidden, desc.norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.parallel = None  # set when the layer is split over tensor-parallel ranks

    @property
    def attention(self) -> nn.Module:
        return self.midlayer.self_attn

    def forward(self, embeds, features, rope):
        layer = self.midlayer
        if features.shape[-1] != embeds.shape[-1]:  # the target's three layers, not the draft's own output
            features = self.fc(features)
        mixed = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        hidden = features + summed(self.parallel, layer.self_attn(mixed, rope))
        return hidden + summed(self.parallel, layer.mlp(layer.post_attention_layernorm(hidden)))

    def top_k(self, outputs, k: int, target_logits):
        best = torch.log_softmax(self.lm_head(self.norm(outputs)).float(), dim=-1).topk(k, dim=-1)
        return torch.return_types.topk((best.values, best.indices + self.d2t[best.indices]))


def feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features: the inputs of layers 2, L // 2 and L - 3 (outputs of the one before)."""
    layers = sorted({2, num_layers // 2, num_layers - 3})
    if len(layers) != 3 or layers[0] < 1:
        raise ZooError(f"EAGLE-3 reads three distinct target layers; a model of {num_layers} layers has no such "
                       "three (it needs at least 8)")
    return [i - 1 for i in layers]


def draft_description(target, folder: Path | None):
    """The draft layer's shape (the target's, with the draft config's own sizes where it has one), its config."""
    desc = copy.deepcopy(target)
    desc.num_layers = 1
    if folder is None:
        return desc, {}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ZooError(f"decoding.heads={folder}: cannot read config.json ({exc})") from None
    if config.get("hidden_size", desc.hidden_size) != desc.hidden_size:
        raise ZooError(f"decoding.heads={folder}: the draft has hidden size {config['hidden_size']}, the model "
                       f"{desc.hidden_size}")
    desc.intermediate_size = config.get("intermediate_size", desc.intermediate_size)
    desc.num_heads = config.get("num_attention_heads", desc.num_heads)
    desc.num_kv_heads = config.get("num_key_value_heads", desc.num_heads)
    desc.norm_eps = config.get("rms_norm_eps", desc.norm_eps)
    desc.head_dim = desc.hidden_size // desc.num_heads
    return desc, config


def load_draft(folder: Path, desc, bias: bool, config: dict) -> nn.Module:
    """EAGLE-3 when the config names a reduced draft vocabulary (its tensors are ``midlayer.*``), else EAGLE-1/2."""
    if "draft_vocab_size" in config:
        draft = Eagle3Draft(desc, config.get("target_hidden_size", desc.hidden_size), config["draft_vocab_size"])
    else:
        draft = EagleDraft(desc, bias)

    def rename(name):  # the target's embedding is used; t2d (the inverse of d2t) is not needed
        return None if name in ("embed_tokens.weight", "t2d") else name.replace("layers.0.", "layer.", 1)

    load_module_weights(draft, folder, WEIGHTS, "decoding.heads", rename)
    return draft


class Eagle(DecodingMethod):
    name = "eagle"

    def __init__(self, engine):
        settings, desc = engine.config["decoding"], engine.description
        if desc.position != "rope" or desc.position_rows != 1:
            raise ZooError(f"decoding=eagle drafts with one rotary position row; {desc.architecture} has "
                           f"{desc.position} positions in {desc.position_rows} row(s)")
        self.top_k, self.depth = int(settings["top_k"]), int(settings["depth"])
        self.max_draft_tokens = int(settings["total_tokens"]) - 1
        if not (1 <= self.top_k <= 64 and 1 <= self.depth <= 16 and self.max_draft_tokens >= 1):
            raise ZooError("decoding=eagle needs top_k in [1, 64], depth in [1, 16] and total_tokens >= 2")
        if self.top_k * self.depth > self.max_draft_tokens:
            raise ZooError(f"decoding=eagle: top_k * depth = {self.top_k * self.depth} expanded nodes need as many "
                           f"draft slots; raise total_tokens above {self.top_k * self.depth}")
        folder = self.folder = heads_folder(engine, self.name)
        if folder is not None and not folder.is_dir():
            raise ZooError(f"decoding.heads={folder}: no such folder")
        draft_desc, config = draft_description(desc, folder)
        self.draft_desc = draft_desc
        if folder is None:
            if settings["version"] not in (1, 3):
                raise ZooError(f"decoding.version={settings['version']!r} must be 1 (EAGLE-1/2) or 3 (EAGLE-3)")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                # A fresh EAGLE-3 head covers the whole vocabulary: its d2t offsets stay zero.
                self.draft = (EagleDraft(draft_desc, True) if settings["version"] == 1
                              else Eagle3Draft(draft_desc, desc.hidden_size, desc.vocab_size))
        else:
            self.draft = load_draft(folder, draft_desc, bool(config.get("bias", True)), config)
        self.layers = feature_layers(desc.num_layers) if isinstance(self.draft, Eagle3Draft) else []
        self.splits_over_ranks = True  # the draft layer splits like the target's layers (zoo_engine_start)
        self.engine = engine
        self.roots: dict[int, tuple[int, torch.Tensor]] = {}  # request id -> (num_tokens, draft feature at n-1)

    def trainer(self, model) -> "EagleTrainer":
        if self.layers:
            raise ZooError("zoo.train trains EAGLE-1/2 drafts (decoding.version=1); EAGLE-3 training is not built")
        return EagleTrainer(self.draft, model, self.draft_desc)

    @hookimpl
    def zoo_engine_start(self, engine, setup):
        if self.folder is None:
            print("note: decoding=eagle starts from a random draft layer (no decoding.heads): tokens are exact, "
                  "nothing is accepted until it is trained", file=sys.stderr)
        if engine.parallel is not None:  # this rank's heads and columns of the draft layer, as of the target's
            draft = self.draft
            if isinstance(draft, Eagle3Draft):  # its reduced-vocabulary head stays whole on every rank
                self.draft = split_module(draft, lambda desc: Eagle3Draft(desc, draft.fc.in_features // 3,
                                                                          draft.lm_head.out_features),
                                          self.draft_desc, engine.parallel, whole=("lm_head.weight",))
                self.draft.parallel = engine.parallel
            else:
                bias = draft.fc.bias is not None
                self.draft = split_module(draft, lambda desc: EagleDraft(desc, bias), self.draft_desc,
                                          engine.parallel)
                self.draft.layer.parallel = engine.parallel
        self.draft = self.draft.to(engine.device, engine.dtype).eval()  # d2t, an integer buffer, stays long
        self.runner = setup.runner  # the engine holds it only once the graphs are captured
        setup.add_kv_layers([self.draft.attention])
        tokens, hidden = setup.limits.max_num_tokens, self.draft.fc.out_features
        target_width = self.draft.fc.in_features if self.layers else hidden  # EAGLE-3 reads three target layers
        setup.add_buffer(BufferSpec(TARGET_FEATURES, (tokens, target_width), dtype=engine.dtype))
        setup.add_buffer(BufferSpec(DRAFT_FEATURES, (tokens, hidden), dtype=engine.dtype))
        # After a verify step a request keeps at most depth + 1 positions; each tree pass expands top_k nodes.
        setup.add_graph_pass(EXTEND, 1 + self.depth, self._extend_pass)
        setup.add_buffer(BufferSpec(ROOT_FEATURES, (setup.limits.max_num_seqs, hidden), dtype=engine.dtype, per="seq"))
        setup.add_buffer(BufferSpec(NUM_TOKENS, (setup.limits.max_num_seqs,), per="seq", fill=2))
        setup.add_graph_pass(GROW, self.top_k, self._grow_pass, tree=True)
        if self.layers:
            setup.capture_layers(self.layers)
        setup.key_blocks_on_next_tokens(1)  # the draft K/V at position j pairs it with token j + 1

    # ------------------------------------------------------------------ one pass of the draft layer

    def _forward(self, context: ForwardContext, features: str) -> torch.Tensor:
        model = self.engine.model.model
        with forward_context(context):
            rope = (model.rotary, model.rotary.prepare(context.positions, self.engine.dtype))
            return self.draft(self.engine.model.token_embeddings(context.buffers["input_ids"]),
                              context.buffers[features], rope)

    def _extend_pass(self, context: ForwardContext):
        return (self._forward(context, TARGET_FEATURES),)

    def _tree_pass(self, context: ForwardContext):
        outputs = self._forward(context, DRAFT_FEATURES)
        best = self.draft.top_k(outputs, self.top_k, self.engine.model.compute_logits)
        return outputs, best.values, best.indices

    def _run(self, family: str, groups, features: torch.Tensor) -> list[torch.Tensor]:
        """The pass's outputs for query tokens laid out by ``groups``: per request (request, queries, draft
        start), each query (token, cache index, position, draft offsets it sees or None for plain causal)."""
        runner = self.runner
        size = runner.pass_size(family, [len(queries) for _, queries, _ in groups])
        layout, rows = StepLayout(1, runner.block_size), []
        for b, (request, queries, draft_start) in enumerate(groups):
            first = len(layout.input_ids)
            layout.offsets.append(first)
            for q, (token, cache_index, position, sees) in enumerate(queries):
                rows.append(first + q)
                layout.input_ids.append(token)
                layout.positions[0].append(position)
                block = request.block_ids[cache_index // runner.block_size]
                layout.slots.append(block * runner.block_size + cache_index % runner.block_size)
                layout.token_seq.append(b)
                layout.query_index.append(q)
                if sees:
                    layout.has_drafts = True
                    layout.draft_visible += [(first + q, offset) for offset in sees]
            layout.visible_rows.append([query[1] for query in queries])
            layout.index_rows.append([query[2] for query in queries])
            layout.context_lens.append(max(query[1] for query in queries) + 1)
            layout.draft_starts.append(draft_start)
            if size is not None:
                layout.pad_entry(runner.graphs.families[family].stride, runner.kv.scratch_block * runner.block_size)
        rows = torch.tensor(rows, device=features.device)
        name = TARGET_FEATURES if family == EXTEND else DRAFT_FEATURES
        runner.buffers[name].index_copy_(0, rows, features.to(runner.buffers[name].dtype))
        outputs = runner.run_pass(family, layout, [g[0].block_ids for g in groups], size)
        return [output[rows] for output in outputs]

    # ------------------------------------------------------------------ extend: follow the target's cache

    @hookimpl
    def zoo_step_results(self, results):
        """Run the pairs (feature at j, token j + 1) of every position the step kept through the draft."""
        if sum(1 for seq in results.sequences if seq.new_tokens) > self.engine.draft_batch_limit:
            # Under load the engine drafts nothing (decoding.disable_by_batch_size): following the target's
            # cache would cost every step for nothing, so the draft stops, and these requests decode plainly.
            self.roots.clear()
            return
        groups, rows, last = [], [], []
        for seq in results.sequences:
            request = seq.request
            if request.is_finished or not seq.rows:
                continue
            first = seq.first_index
            queries = [(request.token_at(j + 1), j, j, None) for j in range(first, first + len(seq.rows))]
            groups.append((request, queries, first + len(seq.rows)))
            rows += seq.rows
            last.append(len(rows) - 1 if first + len(seq.rows) == request.num_tokens - 1 else None)
        if not groups:
            return
        if self.layers:  # EAGLE-3: the low, middle and high layers side by side
            features = torch.cat([results.layer_states(layer, rows) for layer in self.layers], dim=-1)
        else:
            features = results.hidden_states(rows)
        (outputs,) = self._run(EXTEND, groups, features)
        for (request, _, _), row in zip(groups, last):
            if row is not None:  # the request decodes next: its root feature is the last pair's output
                self.roots[request.request_id] = (request.num_tokens, outputs[row])

    @hookimpl
    def zoo_request_finished(self, request):
        self.roots.pop(request.request_id, None)

    # ------------------------------------------------------------------ propose: grow the tree

    @torch.inference_mode()
    def propose(self, requests):
        ready = []
        for request in requests:
            root = self.roots.get(request.request_id)
            # The expanded nodes' K/V go to the slots after the last token: they must exist now.
            if root is not None and root[0] == request.num_tokens and self.engine.blocks.ensure_slots(
                    request, request.num_tokens + self.top_k * self.depth):
                ready.append(request)
        if not ready:
            return {}
        return self._grow(ready)

    def _grow(self, ready) -> dict[int, DraftBlock]:
        """The tree grown on the device as one pass (a graph on CUDA): its result is read once."""
        runner = self.runner
        buffers, size_r = runner.buffers, len(ready)
        block_ids = [r.block_ids for r in ready]
        num_blocks = max(len(b) for b in block_ids)
        buffers["block_tables"][:size_r, :num_blocks].copy_(padded_rows(block_ids, num_blocks), non_blocking=True)
        buffers[NUM_TOKENS][:size_r].copy_(torch.tensor([r.num_tokens for r in ready]), non_blocking=True)
        buffers[ROOT_FEATURES][:size_r] = torch.stack([self.roots[r.request_id][1] for r in ready])
        size, count = runner.pass_size(GROW, [self.top_k] * size_r), size_r * self.top_k
        if size is not None:  # dummies: two tokens, every slot in the scratch block (pad_rows)
            buffers[NUM_TOKENS][size_r:size] = 2
            (picked,) = runner.run_written_pass(GROW, count, size_r, self.top_k, num_blocks, True, size)
        else:  # each tree pass makes its own attention metadata from the buffers it wrote: give views only
            meta = runner.attention_metadata(count, size_r, self.top_k, num_blocks, True, use_kernel=True)
            (picked,) = self._grow_pass(ForwardContext(meta, runner.step_buffers({"token": count, "seq": size_r}), None))
        ids, toks, parents, values = picked[:, :size_r].tolist()
        return {r.request_id: self._block({int(i): [int(t), int(a), v, self._node_depth(int(i))]
                                           for i, t, a, v in zip(ids[b], toks[b], parents[b], values[b])})
                for b, r in enumerate(ready)}

    def _grow_pass(self, context: ForwardContext):
        """``depth`` expansions from the roots in ``ROOT_FEATURES``: each tree pass's inputs come from the
        last pass's top-k by tensor operations, so the host never waits in between.

        Node ids: the root's children 0..k-1, then pass ``p``'s candidates ``k + (p - 2) k^2 + j k + t``
        (child ``t`` of frontier node ``j``). The frontier node ``j`` expanded in pass ``p`` writes its K/V
        at cache index ``n + (p - 2) k + j`` and sees its ancestors' slots (``visible``, offsets from the
        block's start at ``n - 1``, whose slot the draft leaves empty). Returns ``[4, requests, kept]``:
        the likeliest nodes' ids, tokens, parent ids and scores.
        """
        runner, k, meta = self.runner, self.top_k, context.attention
        n, roots = context.buffers[NUM_TOKENS], context.buffers[ROOT_FEATURES]
        size_r, device, num_blocks = n.shape[0], n.device, meta.block_tables.shape[1]
        best = self.draft.top_k(roots, k, self.engine.model.compute_logits)
        scores, tokens, parent_features = best.values, best.indices, roots[:, None].expand(-1, k, -1)
        frontier = torch.arange(k, device=device).expand(size_r, k)
        all_tokens, all_parents, all_scores = [tokens], [torch.full_like(tokens, -1)], [scores]
        visible = torch.zeros(size_r, k, runner.buffers["draft_visible"].shape[1], dtype=torch.int8, device=device)
        columns, seen = torch.arange(k, device=device), torch.ones((), dtype=torch.int8, device=device)
        for p in range(2, self.depth + 1):
            visible[:, columns, (p - 2) * k + columns + 1] = seen  # a device value: a graph captures no host copy
            cache_index = n[:, None] + (p - 2) * k + columns  # [R, k]
            self._write_tree_pass(cache_index, (n - 3 + p)[:, None].expand(-1, k), tokens, visible,
                                  parent_features, n + (p - 1) * k, n - 1)
            # Views of the buffers just written (and a dense mask made from them where the kernel is not used).
            pass_meta = runner.attention_metadata(size_r * k, size_r, k, num_blocks, True)
            outputs, values, indices = self._tree_pass(ForwardContext(pass_meta, context.buffers, None))
            hidden = outputs.view(size_r, k, -1)
            candidates = (scores[:, :, None] + values.view(size_r, k, k)).flatten(1)
            children = indices.view(size_r, k * k)
            all_tokens.append(children)
            all_parents.append(frontier[:, :, None].expand(-1, -1, k).flatten(1))
            all_scores.append(candidates)
            scores, chosen = candidates.topk(k, dim=-1)
            parent = torch.div(chosen, k, rounding_mode="floor")
            frontier = k + (p - 2) * k * k + chosen
            tokens = children.gather(1, chosen)
            parent_features = hidden.gather(1, parent[..., None].expand(-1, -1, hidden.shape[-1]))
            visible = visible.gather(1, parent[..., None].expand(-1, -1, visible.shape[-1]))
        # Only the likeliest nodes can enter the block (a child is never likelier than its parent): keep those.
        node_scores = torch.cat(all_scores, dim=1)
        top_scores, top_ids = node_scores.topk(min(node_scores.shape[1], self.max_draft_tokens + k), dim=-1)
        return (torch.stack([top_ids.double(), torch.cat(all_tokens, 1).gather(1, top_ids).double(),
                             torch.cat(all_parents, 1).gather(1, top_ids).double(), top_scores.double()]),)

    def _node_depth(self, node: int) -> int:
        return 1 if node < self.top_k else 2 + (node - self.top_k) // (self.top_k * self.top_k)

    def _write_tree_pass(self, cache_index, positions, tokens, visible, features, context_lens, draft_start):
        """One tree pass's inputs, written into the step buffers by device operations."""
        runner = self.runner
        buffers, bs = runner.buffers, runner.block_size
        size_r, k = cache_index.shape
        count = size_r * k
        blocks = buffers["block_tables"][:size_r].gather(1, torch.div(cache_index, bs, rounding_mode="floor"))
        buffers["input_ids"][:count] = tokens.flatten()
        buffers["positions"][0, :count] = positions.flatten()
        buffers["slot_mapping"][:count] = (blocks * bs + cache_index % bs).flatten()
        buffers["token_seq"][:count] = torch.arange(size_r, device=cache_index.device).repeat_interleave(k)
        buffers["token_query_index"][:count] = torch.arange(k, device=cache_index.device).repeat(size_r)
        buffers["token_cache_index"][:count] = cache_index.flatten()
        buffers["query_cache_index"][:size_r, :k] = cache_index
        if "query_index_in_sequence" in buffers:
            buffers["query_index_in_sequence"][:size_r, :k] = positions
        buffers["context_lens"][:size_r] = context_lens
        buffers["draft_start"][:size_r] = draft_start
        buffers["draft_visible"][:count] = visible.flatten(0, 1)
        buffers[DRAFT_FEATURES][:count] = features.flatten(0, 1)

    def _block(self, nodes: dict[int, list]) -> DraftBlock:
        """The likeliest nodes (``id -> [token, parent id, score, depth]``), each kept only after its parent,
        laid out likeliest first (so parents first): a block cut to its first n tokens keeps the n likeliest."""
        chosen, kept = [], set()
        for i in sorted(nodes, key=lambda i: (-nodes[i][2], nodes[i][3], i)):
            if len(chosen) == self.max_draft_tokens:
                break
            if nodes[i][1] < 0 or nodes[i][1] in kept:
                chosen.append(i)
                kept.add(i)
        index = {old: new for new, old in enumerate(chosen)}
        return DraftBlock([nodes[i][0] for i in chosen], [index.get(nodes[i][1], -1) for i in chosen])


class EagleTrainer(HeadsTrainer):
    """EAGLE's objective, teacher-forced over whole sequences: the output for pair (feature j, token j + 1)
    regresses the target's feature j + 1 (smooth L1) and its next-token distribution (soft cross-entropy
    through the target's LM head, weight 0.1)."""

    def __init__(self, draft: EagleDraft, model, desc):
        self.module = draft.to(model.lm_head.weight.device, torch.float32).train()
        self.model, self.desc = model, desc
        self.lm_head = model.lm_head.weight.detach().float()

    def loss(self, tokens, features):
        batch, pairs = tokens.shape[0], tokens.shape[1] - 2  # pair j needs feature j + 1: j = 0..L-3
        features = features.float()
        positions = torch.arange(pairs, device=tokens.device).repeat(batch)[None]
        model = self.model.model
        embeds = model.embed_tokens(tokens[:, 1:pairs + 1]).float().flatten(0, 1)
        rope = (model.rotary, model.rotary.prepare(positions, torch.float32))
        with forward_context(ForwardContext(DenseCausal(batch), {}, None)):
            out = self.module(embeds, features[:, :pairs].flatten(0, 1), rope)
        target = features[:, 1:pairs + 1].flatten(0, 1)
        regression = nn.functional.smooth_l1_loss(out, target)
        with torch.no_grad():
            target_probs = torch.softmax(target @ self.lm_head.T, dim=-1)
        classification = -(target_probs * torch.log_softmax(out @ self.lm_head.T, dim=-1)).sum(-1).mean()
        return regression + 0.1 * classification

    def save(self, folder, dtype) -> None:
        from safetensors.torch import save_file

        folder, desc = Path(folder), self.desc
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name.replace("layer.", "layers.0.", 1): value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype).contiguous()
                   for name, value in self.module.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS))
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "hidden_size": desc.hidden_size,
            "intermediate_size": desc.intermediate_size, "num_attention_heads": desc.num_heads,
            "num_key_value_heads": desc.num_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": desc.norm_eps,
            "vocab_size": desc.vocab_size, "hidden_act": "silu", "bias": True}, indent=1))


@hookimpl
def zoo_decoding_methods():
    return {"eagle": Eagle}
