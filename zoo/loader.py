"""Opening checkpoints: HF folders, hub ids, and the embedded random-init default."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.description import ModelDescription
from zoo.errors import ZooError
from zoo.model import DecoderModel
from zoo.plugins import architecture_owners, left_out_note
from zoo.tokenizer import ByteTokenizer, load_tokenizer


@dataclass
class Checkpoint:
    """An opened checkpoint, described but not loaded: its architecture decides which plugins take part."""

    description: ModelDescription
    tokenizer: object
    source: str  # what to tell the user about where the weights come from
    folder: Path | None  # None: the embedded random-init model
    seed: int = 0


def resolve_checkpoint(path: str) -> Path:
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ZooError(f"model.path={path} is a file; give the checkpoint folder that holds config.json")
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ZooError(f"checkpoint folder {path} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many classes
        raise ZooError(f"cannot get checkpoint {path!r}: it is not a local folder and the hub lookup failed "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                       "With HF_HUB_OFFLINE=1 only the local hub cache is used.") from None


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ZooError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ZooError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ZooError(f"{what} {path} must hold a JSON object")
    return data


def describe_model(hf_config: dict, plugin_manager, where: str) -> ModelDescription:
    registry = {name: describe for name, (_, describe) in architecture_owners(plugin_manager).items()}
    names = hf_config.get("architectures") or []
    for name in names:
        if name in registry:
            try:
                return registry[name](hf_config)
            except ZooError:
                raise
            except (KeyError, ValueError, TypeError) as exc:
                raise ZooError(f"{where}: cannot build {name} from its config: {type(exc).__name__}: {exc}") from None
    raise ZooError(f"{where}: unknown architecture {names or '(none given)'}; "
                   f"installed plugins support: {', '.join(sorted(registry)) or 'nothing'}"
                   + left_out_note(plugin_manager))


def new_model(description: ModelDescription, hooks) -> DecoderModel:
    """The generic model with the modules plugins add for this architecture (``zoo_model_build``)."""
    model = DecoderModel(description, hooks)
    hooks.zoo_model_build(model=model, description=description)
    return model


def build_empty_model(description: ModelDescription, hooks, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    with torch.device("meta"):
        model = new_model(description, hooks)
    model = model.to(dtype=dtype).to_empty(device=device)
    _reset_computed_buffers(model, device)
    return model


def _reset_computed_buffers(model: DecoderModel, device: torch.device) -> None:
    # Buffers derived from the description (rotary frequencies) are not in checkpoints.
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)
    if model.description.tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty() and done != total:
        return
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done == total else "\r"
    print(f"{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr, flush=True)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ZooError(f"weight index {index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ZooError(f"weight index {index} names {f.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ZooError(f"no *.safetensors weights in {folder}")
    return files


def load_weights(model: DecoderModel, folder: Path, hooks, parallel=None, full=None) -> None:
    """Every parameter from the folder's safetensors. With ``parallel`` (a tensor-parallel rank, ``full`` the
    unsplit description) each tensor is read as this rank's slice only; ``model.loaded_bytes`` counts them."""
    from safetensors import SafetensorError, safe_open

    from zoo.parallel import read_shard, take_shard

    params = dict(model.named_parameters(remove_duplicate=False))
    model.loaded_bytes = 0
    # Checkpoints an architecture plugin converts (fused q/k/v, transposed products) are read whole, converted,
    # then cut to this rank's slices; the Llama layout is read as slices straight from the file.
    converts = bool(hooks.zoo_weights_convert.get_hookimpls())
    loaded: set[str] = set()
    unexpected: list[str] = []
    files = _safetensors_files(folder)
    _progress(0, len(files), "loading weights")
    for done, file in enumerate(files, 1):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:  # memory-mapped
                for name in reader.keys():
                    if parallel is not None and not converts:
                        if name not in params:
                            unexpected.append(name)
                            continue
                        tensor = read_shard(reader, name, full, parallel, tuple(params[name].shape))
                    else:
                        tensor = reader.get_tensor(name)
                    model.loaded_bytes += tensor.numel() * tensor.element_size()
                    converted = hooks.zoo_weights_convert(description=full or model.description, name=name,
                                                          tensor=tensor)
                    for zoo_name, value in converted if converted is not None else [(name, tensor)]:
                        param = params.get(zoo_name)
                        if param is None:
                            unexpected.append(name)
                            continue
                        if parallel is not None and converts:
                            value = take_shard(value, tuple(value.shape), zoo_name, full, parallel,
                                               tuple(param.shape))
                        if tuple(param.shape) != tuple(value.shape):
                            raise ZooError(f"{file.name}: tensor {name} has shape {tuple(value.shape)}, "
                                           f"the model expects {tuple(param.shape)} for {zoo_name}")
                        with torch.no_grad():
                            param.copy_(value)  # converts to the model's dtype and device
                        loaded.add(zoo_name)
        except (SafetensorError, OSError) as exc:
            raise ZooError(f"checkpoint file {file} is corrupt or unreadable: {exc}") from None
        _progress(done, len(files), "loading weights")
    if model.description.tied_embeddings:
        if "lm_head.weight" in loaded:
            loaded.add("model.embed_tokens.weight")
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ZooError(f"checkpoint {folder} is missing weights: {shown}")
    if unexpected:
        print(f"note: ignored {len(unexpected)} checkpoint tensors zoo does not use "
              f"(e.g. {unexpected[0]})", file=sys.stderr)


def _eos_ids(folder: Path, hf_config: dict, tokenizer) -> list[int]:
    eos = None
    generation = folder / "generation_config.json"
    if generation.exists():
        eos = read_json(generation, "generation config").get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def open_checkpoint(model_cfg, plugin_manager) -> Checkpoint:
    """Describe the checkpoint ``model.path`` names, or the embedded default (``model.embedded``): a checkpoint
    folder shipped inside the package (a string), or a config.json built with random weights (a mapping)."""
    if model_cfg.get("path"):
        folder = resolve_checkpoint(str(model_cfg["path"]))
        return _open_folder(folder, plugin_manager, f"checkpoint {folder}")
    embedded = model_cfg.get("embedded")
    if not embedded:
        raise ZooError(f"model option {model_cfg.get('name')!r} has no embedded default: set model.path")
    if isinstance(embedded, str):
        folder = Path(__file__).parent / embedded
        return _open_folder(folder, plugin_manager, f"embedded default {folder} (a small model trained on Python's "
                                                    "standard library by zoo.pretrain; set model.path for others)")
    tokenizer = ByteTokenizer()
    hf_config = {k: v for k, v in dict(embedded).items() if k != "seed"}
    hf_config["vocab_size"] = tokenizer.vocab_size
    description = describe_model(hf_config, plugin_manager, "embedded model config")
    description.eos_token_ids = [tokenizer.eos_token_id]
    seed = int(embedded.get("seed", 0))
    source = (f"embedded default {hf_config['architectures'][0]} (RANDOM-INIT weights, seed {seed}: the text is "
              "noise; set model.path to load a checkpoint)")
    return Checkpoint(description, tokenizer, source, None, seed)


def _open_folder(folder: Path, plugin_manager, source: str) -> Checkpoint:
    hf_config = read_json(folder / "config.json", "model config")
    description = describe_model(hf_config, plugin_manager, str(folder / "config.json"))
    tokenizer = load_tokenizer(folder)
    description.eos_token_ids = _eos_ids(folder, hf_config, tokenizer)
    return Checkpoint(description, tokenizer, source, folder)


def load_model(checkpoint: Checkpoint, hooks, dtype: torch.dtype, device: torch.device,
               parallel=None) -> DecoderModel:
    """The model with the weights of the checkpoint, or random ones from the embedded default's seed.
    With ``parallel``, this rank's slices of a checkpoint's weights (``zoo.parallel``)."""
    if parallel is not None:
        from zoo.parallel import split_description

        if checkpoint.folder is None:
            raise ZooError("runtime.tensor_parallel_size > 1 needs a checkpoint folder (model.path=...)")
        model = build_empty_model(split_description(checkpoint.description, parallel.world), hooks, dtype, device)
        load_weights(model, checkpoint.folder, hooks, parallel, checkpoint.description)
        model.use_tensor_parallel(parallel)
        return model.eval()
    if checkpoint.folder is not None:
        model = build_empty_model(checkpoint.description, hooks, dtype, device)
        load_weights(model, checkpoint.folder, hooks)
        return model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(checkpoint.seed)
        model = new_model(checkpoint.description, hooks)
    model = model.to(device=device, dtype=dtype)
    _reset_computed_buffers(model, device)
    return model.eval()


def load_module_weights(module: torch.nn.Module, folder: Path, filename: str, what: str, rename=None,
                        model: str = "this model") -> None:
    """Fill ``module`` from ``folder/filename`` (safetensors), every tensor by name and shape, or fail in one line.

    ``rename(name)`` maps a file's names onto the module's (None drops a tensor). A pickle beside it is refused
    with how to convert it: loading one runs code.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / filename
    if not path.exists():
        pickled = sorted(p.name for pattern in ("*.bin", "*.pt") for p in folder.glob(pattern))
        hint = (f"; {pickled[0]} is a pickle, which zoo does not load (loading it runs code): convert it with "
                f"safetensors.torch.save_file(torch.load(...), '{filename}')") if pickled else ""
        raise ZooError(f"{what}={folder}: {filename} not found{hint}")
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ZooError(f"{what}={folder}: cannot read {filename} ({exc})") from None
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items() if rename(k) is not None}
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        wrong = sorted(k for k in expected if got.get(k) != expected[k]) or sorted(set(got) - set(expected))
        raise ZooError(f"{what}={folder}: the weights do not fit {model}: {wrong[0]} is {got.get(wrong[0])}, "
                       f"expected {expected.get(wrong[0])}")
    module.load_state_dict(tensors)
