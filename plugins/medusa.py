"""Medusa (Cai et al. 2024): heads on the last hidden state propose a static tree of draft tokens.

Head ``k`` (residual blocks, then a vocabulary projection) reads the hidden
state that predicted the last committed token and guesses the token ``k + 1``
places after it. The tree comes in Medusa's ``medusa_choices`` format: each
node is a path of top-k ranks, ``[0, 1]`` being the head-1 token of rank 1
under the head-0 token of rank 0; the default is the reference repository's
63-node ``mc_sim_7b_63``. The core verifies the tree (exact under greedy,
distribution-preserving under sampling).

``decoding.heads=DIR`` loads heads in the reference layout: ``config.json``
with ``medusa_num_heads`` and ``medusa_num_layers``, and
``medusa_lm_head.safetensors`` with ``{head}.{layer}.linear.weight|bias`` and
``{head}.{num_layers}.weight``. Without it the heads start fresh, as Medusa
initialises them (identity blocks, the model's own LM head): tokens stay
exact, with little speedup.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from zoo import DecodingMethod, DraftBlock, HeadsTrainer, Scope, ZooError, hookimpl
from zoo.decoding import heads_folder
from zoo.loader import load_module_weights
from zoo.step import BufferSpec

zoo_scope = Scope(option="decoding=medusa")
HEADS_PASS, LAST_HIDDEN = "medusa_heads", "medusa_last_hidden"  # the heads' graph family and what it reads

# FasterDecoding/Medusa, medusa/model/medusa_choices.py: the 63-node tree tuned for Vicuna-7B.
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
                [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
                [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
                [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
                [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1],
                [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]
HEADS_FILE = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """``num_heads`` heads of ``num_layers`` residual blocks and a vocabulary projection (the reference's keys)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int):
        super().__init__(nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                                       nn.Linear(hidden_size, vocab_size, bias=False)) for _ in range(num_heads))

    def fresh(self, lm_head_weight: torch.Tensor) -> None:
        """Medusa's initialisation: blocks that pass their input through, the model's LM head."""
        with torch.no_grad():
            for head in self:
                for block in head[:-1]:
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
                head[-1].weight.copy_(lm_head_weight)


def parse_tree(choices, num_heads: int) -> tuple[list[list[int]], list[int]]:
    """Sorted paths and each one's parent index (-1: the last committed token); ZooError if malformed."""
    if not isinstance(choices, list) or not choices:
        raise ZooError("decoding.tree must be a non-empty list of paths such as [[0], [0, 0], [1]]")
    paths = []
    for path in choices:
        if not (isinstance(path, (list, tuple)) and path
                and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ZooError(f"decoding.tree: {path!r} is not a path of top-k ranks (a non-empty list of ints >= 0)")
        paths.append(list(path))
    paths.sort(key=lambda p: (len(p), p))  # parents before children, as the verifier needs
    index = {tuple(p): i for i, p in enumerate(paths)}
    if len(index) != len(paths):
        raise ZooError("decoding.tree lists a path twice")
    deepest = max(len(p) for p in paths)
    if deepest > num_heads:
        raise ZooError(f"decoding.tree goes {deepest} deep; the Medusa heads predict {num_heads} tokens ahead")
    missing = [p for p in paths if len(p) > 1 and tuple(p[:-1]) not in index]
    if missing:
        raise ZooError(f"decoding.tree: the parent of {missing[0]} is not in the tree")
    return paths, [index[tuple(p[:-1])] if len(p) > 1 else -1 for p in paths]


def load_heads(folder: str, hidden_size: int, vocab_size: int) -> MedusaHeads:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ZooError(f"decoding.heads={folder}: no such folder")
    try:
        config = json.loads((path / "config.json").read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ZooError(f"decoding.heads={folder}: cannot read the Medusa config ({type(exc).__name__}: {exc})") from None
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers)
    load_module_weights(heads, path, HEADS_FILE, "decoding.heads",
                        model=f"this model (hidden {hidden_size}, vocabulary {vocab_size})")
    return heads


class Medusa(DecodingMethod):
    name = "medusa"
    splits_over_ranks = True  # its heads read the final hidden states, whole on every rank: each rank runs them all

    def __init__(self, engine):
        """Settings and heads files are checked here, before the model's weights load."""
        settings, desc = engine.config["decoding"], engine.description
        folder = heads_folder(engine, self.name)
        self.fresh = folder is None
        if self.fresh:
            self.heads = MedusaHeads(desc.hidden_size, desc.vocab_size, int(settings["num_heads"]),
                                     int(settings["num_layers"]))
        else:
            self.heads = load_heads(str(folder), desc.hidden_size, desc.vocab_size)
        tree = settings["tree"]
        tree = OmegaConf.to_container(tree) if OmegaConf.is_config(tree) else tree
        self.paths, self.parents = parse_tree(tree or MC_SIM_7B_63, len(self.heads))
        self.max_draft_tokens = len(self.paths)
        self.top_k = 1 + max(p[-1] for p in self.paths)
        self.last_hidden: dict[int, torch.Tensor] = {}  # request id -> the state that predicted its last token
        if settings["acceptance"] not in ("exact", "typical"):
            raise ZooError(f"decoding.acceptance={settings['acceptance']!r} must be exact or typical")
        if settings["acceptance"] == "typical":
            self.threshold, self.alpha = float(settings["posterior_threshold"]), float(settings["posterior_alpha"])
            self.accept = self.typical_acceptance

    def typical_acceptance(self, target: torch.Tensor, tokens: list[int]) -> int | None:
        """The first child whose target probability clears min(threshold, alpha * exp(-entropy))."""
        entropy = -(target * target.clamp(min=1e-20).log()).sum()
        bar = min(self.threshold, self.alpha * float(torch.exp(-entropy)))
        return next((i for i, t in enumerate(tokens) if float(target[t]) > bar), None)

    def trainer(self, model) -> "MedusaTrainer":
        return MedusaTrainer(self.heads, model, self.fresh)

    @hookimpl
    def zoo_engine_start(self, engine, setup):
        if self.fresh:
            self.heads.fresh(engine.model.lm_head_weight())
            print(f"note: decoding=medusa starts from fresh heads ({len(self.heads)} heads, no decoding.heads): "
                  "tokens are exact, the speedup needs trained heads", file=sys.stderr)
        self.heads = self.heads.to(engine.device, engine.dtype).eval()
        self.runner = setup.runner
        setup.add_buffer(BufferSpec(LAST_HIDDEN, (setup.limits.max_num_seqs, engine.description.hidden_size),
                                    dtype=engine.dtype, per="seq"))
        # The heads' dozens of small kernels replay as one graph per batch size: at batch 1 they are launch-bound.
        setup.add_graph_pass(HEADS_PASS, 1, lambda context: (self._ranked(context.buffers[LAST_HIDDEN]),))

    def _ranked(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[depth, requests, top_k]``: each head's likeliest tokens."""
        depth = max(len(p) for p in self.paths)
        return torch.stack([self.heads[k](hidden).topk(self.top_k, dim=-1).indices for k in range(depth)])

    @torch.inference_mode()
    def propose(self, requests):
        ready = [r for r in requests if r.request_id in self.last_hidden]
        if not ready:
            return {}
        hidden = torch.stack([self.last_hidden[r.request_id] for r in ready])
        size = self.runner.pass_size(HEADS_PASS, [1] * len(ready))
        if size is None:
            ranked = self._ranked(hidden)
        else:
            self.runner.buffers[LAST_HIDDEN][:len(ready)] = hidden
            ranked = self.runner.run_written_pass(HEADS_PASS, len(ready), len(ready), 1, 1, False, size)[0]
        ranked = ranked[:, :len(ready)].tolist()  # [depth][request][rank], one copy to the host
        return {r.request_id: DraftBlock([ranked[len(p) - 1][b][p[-1]] for p in self.paths], list(self.parents))
                for b, r in enumerate(ready)}

    @hookimpl
    def zoo_step_results(self, results):
        advanced = [s for s in results.sequences if s.new_tokens]
        if advanced:
            states = results.hidden_states([s.rows[-1] for s in advanced])  # a copy: the step's buffer is reused
            for seq, state in zip(advanced, states):
                self.last_hidden[seq.request.request_id] = state

    @hookimpl
    def zoo_request_finished(self, request):
        self.last_hidden.pop(request.request_id, None)


class MedusaTrainer(HeadsTrainer):
    """Head ``k`` at position ``j`` learns the token at ``j + k + 2`` (the target's own), weighted 0.8 ** k
    as in the Medusa paper; fresh heads start from Medusa's initialisation."""

    def __init__(self, heads: MedusaHeads, model, fresh: bool):
        if fresh:
            heads.fresh(model.lm_head_weight())
        self.module = heads.to(model.lm_head.weight.device, torch.float32).train()

    def loss(self, tokens, features):
        length, total, weights = tokens.shape[1], 0.0, 0.0
        for k, head in enumerate(self.module):
            if length - k - 2 < 1:
                break
            logits = head(features[:, :length - k - 2].float())
            total = total + 0.8 ** k * nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, k + 2:].flatten())
            weights += 0.8 ** k
        return total / weights

    def save(self, folder, dtype) -> None:
        from safetensors.torch import save_file

        heads = self.module
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in heads.state_dict().items()}, str(folder / HEADS_FILE))
        (folder / "config.json").write_text(json.dumps({
            "medusa_num_heads": len(heads), "medusa_num_layers": len(heads[0]) - 1,
            "hidden_size": heads[0][-1].in_features, "vocab_size": heads[0][-1].out_features}, indent=1))


@hookimpl
def zoo_decoding_methods():
    return {"medusa": Medusa}
