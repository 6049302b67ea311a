"""``python -m zoo.pretrain``: a small Llama-shaped target, trained on text every machine has.

    python -m zoo.pretrain out=DIR                        # tiny: two CPU cores, about two minutes
    python -m zoo.pretrain out=DIR target_size=h200       # ~100M parameters on one GPU, about three minutes

The text is the source of Python's standard library (the ``.py`` files under
``sysconfig``'s stdlib path, sorted, tests left out); the vocabulary is a
byte-level BPE trained on the same text by ``tokenizers``. The result is an
ordinary HF checkpoint folder (``config.json``, ``model.safetensors``,
``tokenizer.json``) that zoo and transformers both load. The model is zoo's
own decoder run in :class:`zoo.model.DenseCausal` mode, so the weights carry
HF Llama names as they are.
"""

from __future__ import annotations

import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from zoo.config import cli_main, exit_on_error
from zoo.engine_setup import DTYPES
from zoo.errors import ZooError
from zoo.forward_context import ForwardContext, forward_context
from zoo.loader import describe_model
from zoo.model import DenseCausal, DecoderModel
from zoo.plugins import load_plugins

EOS = "<|endoftext|>"


def stdlib_texts(max_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"test", "tests", "site-packages", "idle_test", "lib2to3", "encodings", "pydoc_data"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:
        raise ZooError(f"no Python sources found under {root}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def hf_config(size: DictConfig, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(size.vocab_size), "hidden_size": int(size.hidden_size),
        "intermediate_size": int(size.intermediate_size), "num_hidden_layers": int(size.num_hidden_layers),
        "num_attention_heads": int(size.num_attention_heads), "num_key_value_heads": int(size.num_key_value_heads),
        "max_position_embeddings": int(size.max_position_embeddings), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "initializer_range": 0.02,
    }


def causal_lm_loss(model: DecoderModel, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over ``[B, T + 1]`` token windows."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    batch, length = inputs.shape
    positions = torch.arange(length, device=windows.device).repeat(batch)[None]
    with forward_context(ForwardContext(DenseCausal(batch), {}, None)):
        hidden = model(inputs.reshape(-1), positions)
    logits = model.lm_head(hidden).float()
    return torch.nn.functional.cross_entropy(logits, targets.reshape(-1))


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def out_folder(value) -> Path:
    if not value:
        raise ZooError("set out=DIR: the checkpoint folder to write")
    folder = Path(str(value)).expanduser()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ZooError(f"out={folder} exists and is not an empty folder")
    return folder


def pretrain(cfg: DictConfig) -> Path:
    from tqdm import tqdm

    folder = out_folder(cfg.out)
    size = cfg.target_size
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else "cpu" if cfg.device == "auto" else str(cfg.device))
    torch.manual_seed(int(cfg.seed))
    started = time.perf_counter()
    texts = stdlib_texts(int(cfg.max_corpus_chars))
    tokenizer = train_tokenizer(texts, int(size.vocab_size))
    eos_id = tokenizer.token_to_id(EOS)
    stream = []
    for encoding in tokenizer.encode_batch(texts):
        stream += encoding.ids + [eos_id]
    stream = torch.tensor(stream, dtype=torch.long)
    split = int(len(stream) * (1 - float(cfg.held_out)))
    train_ids, held_ids = stream[:split].to(device), stream[split:].to(device)
    print(f"corpus: {len(texts)} standard-library files, {len(stream):,} tokens "
          f"(vocabulary {tokenizer.get_vocab_size()}), tokenizer in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)

    config = hf_config(size, eos_id)
    # The plain Llama of the llama plugin's description: no build hooks needed, none of a run's plugins apply.
    model = DecoderModel(describe_model(config, load_plugins(), "zoo.pretrain config")).to(device)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(size.lr), betas=(0.9, 0.95), weight_decay=0.1)
    length, batch, steps = int(size.seq_len), int(size.batch_size), int(size.steps)
    generator = torch.Generator(device="cpu").manual_seed(int(cfg.seed))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    deadline = started + float(size.time_limit_s)
    log, step = [], 0
    bar = tqdm(total=steps, desc=f"pretrain {parameters / 1e6:.1f}M", unit="step", file=sys.stderr,
               dynamic_ncols=True)
    try:
        for step in range(steps):
            if time.perf_counter() > deadline:
                break
            starts = torch.randint(0, len(train_ids) - length - 1, (batch,), generator=generator)
            windows = torch.stack([train_ids[s:s + length + 1] for s in starts.tolist()])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, float(size.lr), int(size.warmup))
            with autocast:
                loss = causal_lm_loss(model, windows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            log.append({"step": step, "loss": round(loss.item(), 4)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}: saving the model as it is", file=sys.stderr)
    bar.close()
    model.eval()
    with torch.no_grad(), autocast:
        usable = (len(held_ids) - 1) // (length + 1) * (length + 1)
        held = held_ids[:min(usable, 16 * (length + 1))].view(-1, length + 1)
        held_loss = causal_lm_loss(model, held).item() if len(held) else float("nan")
    save_checkpoint(model, config, tokenizer, folder, DTYPES[str(cfg.save_dtype)])
    report = {"parameters": parameters, "steps": len(log), "seconds": round(time.perf_counter() - started, 1),
              "train_loss": log[-1]["loss"] if log else None, "held_out_loss": round(held_loss, 4),
              "corpus_tokens": len(stream), "config": OmegaConf.to_container(size), "log": log}
    (folder / "pretrain_log.json").write_text(json.dumps(report, indent=1))
    print(f"saved {folder}: {parameters / 1e6:.2f}M parameters, {len(log)} steps in {report['seconds']} s, "
          f"held-out loss {held_loss:.3f}", file=sys.stderr)
    return folder


def save_checkpoint(model: DecoderModel, config: dict, tokenizer, folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().to("cpu", dtype).contiguous() for name, value in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"],
                                                               "bos_token_id": config["bos_token_id"]}))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
        "model_max_length": config["max_position_embeddings"]}))


@hydra.main(config_path="pkg://zoo_conf", config_name="pretrain", version_base=None)
def _main(cfg: DictConfig) -> None:
    OmegaConf.set_struct(cfg, True)
    folder = exit_on_error(lambda: pretrain(cfg))
    from zoo import LLM, SamplingParams

    out = LLM(str(folder), dtype="float32").generate([str(cfg.sample_prompt)],
                                                     SamplingParams(max_new_tokens=48))[0]
    print(f"sample: {cfg.sample_prompt}{out.text}")


def main() -> None:
    cli_main(_main, "pretrain")


if __name__ == "__main__":
    main()
