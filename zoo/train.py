"""``python -m zoo.train``: draft heads trained by self-distillation from their target.

    python -m zoo.train decoding=eagle model.path=DIR train.out=HEADS [train.prompts=FILE] [train.steps=N]
    python -m zoo.run model.path=DIR decoding=eagle decoding.heads=HEADS

The target writes continuations of the prompts (greedy, through zoo's own
engine) and its final hidden states are taken from the step-results hook as
it goes; the chosen method's trainer (:class:`zoo.decoding.HeadsTrainer`)
learns from that text and those states, and saves the heads in the layout its
``decoding.heads`` loads. Prompts come from a JSONL file, or the target
samples them. Held-out prompts end the run with an acceptance report.
Ctrl-C saves the heads trained so far.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from zoo.config import cli_main, exit_on_error
from zoo.decoding import HeadsTrainer
from zoo.engine_setup import DTYPES
from zoo.errors import ZooError
from zoo.llm import LLM
from zoo.plugins import hookimpl, load_plugins, registered_names
from zoo.run import read_jsonl
from zoo.sampling_params import SamplingParams

HEADS_MARKERS = ("config.json", "model.safetensors", "medusa_lm_head.safetensors", "train_log.json", "loss.png")


class FeatureRecorder:
    """Each finished request's tokens ``[n]`` and final hidden states ``[n - 1, hidden]`` (positions
    ``0..n-2``, each the state that predicted the next token), gathered step by step."""

    name = "zoo_train_features"

    def __init__(self):
        self.states: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.sequences: list[tuple[torch.Tensor, torch.Tensor]] = []

    @hookimpl
    def zoo_step_results(self, results):
        for seq in results.sequences:
            if seq.rows:
                self.states.setdefault(seq.request.request_id, []).append(
                    (seq.first_index, results.hidden_states(seq.rows)))

    @hookimpl
    def zoo_request_finished(self, request):
        parts = sorted(self.states.pop(request.request_id, []), key=lambda part: part[0])
        if parts and not request.error:
            features = torch.cat([states for _, states in parts])
            tokens = torch.tensor(request.token_ids[:len(features) + 1], device=features.device)
            self.sequences.append((tokens, features))


def out_folder(value) -> Path:
    if not value:
        raise ZooError("set train.out=DIR: the heads folder to write")
    folder = Path(str(value)).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise ZooError(f"train.out={folder} exists and is not a folder")
        names = {p.name for p in folder.iterdir()}
        if names and not names & set(HEADS_MARKERS):
            raise ZooError(f"train.out={folder} exists and is not a heads folder (it holds {sorted(names)[0]}); "
                           "choose a new or empty folder")
    return folder


def read_prompts(path) -> list[dict]:
    path = Path(str(path)).expanduser()
    prompts = []
    for record in read_jsonl(path, "train.prompts"):
        if "_error" in record:
            raise ZooError(f"train.prompts: {record['_error']}")
        if not ("prompt" in record or "prompt_ids" in record):
            raise ZooError(f"train.prompts={path}: a record without \"prompt\" or \"prompt_ids\": {record}")
        prompts.append({k: record[k] for k in ("prompt", "prompt_ids") if k in record})
    if not prompts:
        raise ZooError(f"train.prompts={path} holds no prompts")
    return prompts


def sampled_prompts(llm: LLM, count: int, length: int, seed: int) -> list[dict]:
    """The target's own openings: ``length`` tokens sampled at temperature 1 after one random token."""
    vocab = llm.engine.description.vocab_size
    rng = random.Random(seed)
    starts = [{"prompt_ids": [rng.randrange(vocab)]} for _ in range(count)]
    params = SamplingParams(max_new_tokens=length, temperature=1.0, seed=seed, ignore_eos=True)
    return [{"prompt_ids": start["prompt_ids"] + out.token_ids}
            for start, out in zip(starts, llm.generate(starts, params))]


def method_trainer(cfg: DictConfig, llm: LLM) -> HeadsTrainer:
    """The chosen method, built as its engine would build it, and its trainer over the loaded target."""
    name = cfg.decoding.name
    registry = registered_names(load_plugins().hook.zoo_decoding_methods, "decoding method")
    if name not in registry:
        raise ZooError(f"decoding={name}: zoo.train needs a method with weights (decoding=medusa or eagle, or "
                       f"another registered one: {', '.join(sorted(registry))})")
    target = llm.engine

    class MethodSetting:  # what a method reads of its engine while it is built
        config, description = cfg, target.description

    return registry[name][1](MethodSetting).trainer(target.model)


def batches(sequences, batch_size: int, rng: random.Random):
    """Endless shuffled batches, each cut to its shortest sequence (dense causal attention wants equal lengths)."""
    order = []
    while True:
        if len(order) < batch_size:
            order += rng.sample(range(len(sequences)), len(sequences))
        chosen, order = [sequences[i] for i in order[:batch_size]], order[batch_size:]
        length = min(len(tokens) for tokens, _ in chosen)
        yield (torch.stack([tokens[:length] for tokens, _ in chosen]),
               torch.stack([features[:length - 1] for _, features in chosen]))


def train(cfg: DictConfig) -> dict:
    from tqdm import tqdm

    settings = cfg.train
    folder = out_folder(settings.out)
    prompts = read_prompts(settings.prompts) if settings.prompts else None
    if cfg.decoding.name in (None, "none"):
        raise ZooError("choose the heads to train: decoding=medusa or decoding=eagle")
    generation = OmegaConf.merge(cfg, {"decoding": {"name": "none"}})  # the target alone writes the text
    recorder = FeatureRecorder()
    llm = LLM(config=generation, plugins=[recorder])
    trainer = method_trainer(cfg, llm)
    seed = int(settings.seed)
    torch.manual_seed(seed)
    if prompts is None:
        prompts = sampled_prompts(llm, int(settings.num_prompts), int(settings.prompt_tokens), seed)
    held = max(1, round(len(prompts) * float(settings.held_out))) if len(prompts) > 1 else 0
    training, held_out = prompts[held:], prompts[:held]

    started = time.perf_counter()
    params = SamplingParams(max_new_tokens=int(settings.max_new_tokens), ignore_eos=True)
    recorder.sequences.clear()  # the sampled prompts' own generation
    llm.generate(training, params)
    sequences = [(tokens, features) for tokens, features in recorder.sequences if len(tokens) >= 4]
    if not sequences:
        raise ZooError("no training text: every prompt failed or was too short")
    print(f"training text: {len(sequences)} continuations, {sum(len(t) for t, _ in sequences)} tokens "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)

    module = trainer.module
    optimizer = torch.optim.AdamW(module.parameters(), lr=float(settings.lr), weight_decay=0.0)
    steps, batch_size = int(settings.steps), int(settings.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(steps, 1))
    log, interrupted, source = [], False, batches(sequences, min(batch_size, len(sequences)), random.Random(seed))
    trained_tokens, train_start = 0, time.perf_counter()
    bar = tqdm(total=steps, desc=f"train {cfg.decoding.name}", unit="step", file=sys.stderr, mininterval=0.5,
               dynamic_ncols=True)
    try:
        for step in range(steps):
            tokens, features = next(source)
            loss = trainer.loss(tokens, features)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            trained_tokens += tokens.numel()
            elapsed = time.perf_counter() - train_start
            log.append({"step": step, "loss": round(loss.item(), 5), "seconds": round(elapsed, 2)})
            bar.set_postfix(loss=f"{loss.item():.4f}", tokens_per_s=f"{trained_tokens / elapsed:.0f}")
            bar.update()
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted after {len(log)} steps: saving the heads trained so far", file=sys.stderr)
    bar.close()
    module.eval()
    trainer.save(folder, DTYPES[str(settings.save_dtype)])
    report = {"method": cfg.decoding.name, "steps": len(log), "interrupted": interrupted,
              "sequences": len(sequences), "held_out_prompts": len(held_out), "log": log}
    plot_loss(log, folder / "loss.png", cfg.decoding.name)
    if held_out and not interrupted:
        report["held_out"] = acceptance_report(cfg, folder, held_out, params, llm)
    (folder / "train_log.json").write_text(json.dumps(report, indent=1))
    return report


def acceptance_report(cfg: DictConfig, folder: Path, prompts: list[dict], params: SamplingParams, plain: LLM):
    """The trained heads on held-out prompts: accepted length, acceptance by depth, tokens against plain decoding."""
    expected = [out.token_ids for out in plain.generate(prompts, params)]
    drafted = LLM(config=OmegaConf.merge(cfg, {"decoding": {"heads": str(folder)}}))
    outputs = drafted.generate(prompts, params)
    stats = drafted.engine.stats
    accepted = stats.accepted_depth + [0] * (len(stats.drafted_depth) - len(stats.accepted_depth))
    result = {"mean_accepted_length": round(stats.generated_tokens / max(stats.token_steps, 1), 3),
              "acceptance_by_depth": [round(a / n, 3) for n, a in zip(stats.drafted_depth, accepted) if n],
              "tokens_identical_to_plain": [o.token_ids for o in outputs] == expected}
    print(f"held-out ({len(prompts)} prompts): mean accepted length {result['mean_accepted_length']:.2f} tokens per "
          f"step; acceptance by draft depth " + "  ".join(f"{d + 1}: {a:.2f}" for d, a in
                                                          enumerate(result["acceptance_by_depth"])) +
          f"; tokens identical to plain decoding: {'yes' if result['tokens_identical_to_plain'] else 'NO'}",
          file=sys.stderr)
    return result


def plot_loss(log: list[dict], path: Path, method: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("note: no loss plot (pip install 'zoo-runtime[train]' brings matplotlib)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    axes.plot([r["step"] for r in log], [r["loss"] for r in log])
    axes.set(xlabel="step", ylabel="loss", title=f"zoo.train decoding={method}", yscale="log")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


@hydra.main(config_path="pkg://zoo_conf", config_name="train", version_base=None)
def _main(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, True)
    report = exit_on_error(lambda: train(cfg))
    print(f"saved {cfg.train.out} ({report['steps']} steps); use it with decoding={cfg.decoding.name} "
          f"decoding.heads={cfg.train.out}", file=sys.stderr)


def main() -> None:
    cli_main(_main, "train")


if __name__ == "__main__":
    main()
