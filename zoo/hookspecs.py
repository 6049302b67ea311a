"""Every hook zoo calls, in the order a run meets them.

Hook names are ``zoo_<stage>_<verb>``. "Contribute" hooks collect a result from
every plugin and the core merges them; ``firstresult`` hooks ask for one answer
and stop at the first plugin that returns something other than ``None``.
Implementations may take fewer arguments than the spec lists, so specs can grow
without breaking plugins (pluggy passes arguments by name).

Only plugins that take part in the run are called (see :mod:`zoo.plugins`): an
architecture plugin for its own architectures, a feature plugin when its
config option is chosen. The two hooks under "Start-up" are the exception:
they are asked of every loaded plugin, before that choice is made.

Plugins mark implementations with ``zoo.hookimpl``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import pluggy

if TYPE_CHECKING:
    import torch

    from zoo.adapters import AdapterKind
    from zoo.decoding import DecodingMethod
    from zoo.description import ModelDescription
    from zoo.engine import Engine
    from zoo.engine_setup import EngineSetup
    from zoo.forward_context import ForwardContext
    from zoo.model import DecoderModel
    from zoo.request import Request
    from zoo.step import StepBatch, StepResults

hookspec = pluggy.HookspecMarker("zoo")

# ----------------------------------------------------------------------------
# Start-up: asked of every loaded plugin, before the run's plugins are chosen
# ----------------------------------------------------------------------------


@hookspec
def zoo_config_register(config_store: Any) -> None:
    """Add options to Hydra config groups.

    Runs once per process, before Hydra composes the config. ``config_store``
    is Hydra's ``ConfigStore``; ``config_store.store(group="processor",
    name="my_option", node={...})`` makes ``processor=my_option`` selectable.
    """


@hookspec
def zoo_model_architectures() -> dict[str, Callable[[dict], "ModelDescription"]]:
    """Name the HF architectures this plugin builds.

    Runs when a checkpoint is opened. Returns ``{architecture: describe}``,
    ``describe(hf_config) -> zoo.ModelDescription`` (raise ``zoo.ZooError`` for
    settings it cannot honour). Contribute; two plugins claiming one name is an
    error. A plugin that returns architectures takes part in a run only when the
    checkpoint is one of them, so its other hooks never see other models.
    """


# ----------------------------------------------------------------------------
# Model: modules and weights
# ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def zoo_weights_convert(description: "ModelDescription", name: str,
                        tensor: "torch.Tensor") -> list[tuple[str, "torch.Tensor"]] | None:
    """Map one checkpoint tensor onto zoo's parameter names.

    Runs for every tensor of the checkpoint before it is copied into the model.
    Returns ``(zoo_name, tensor)`` pairs (none to skip the tensor; several to
    split a fused weight). firstresult; with no answer the name is used as is.
    """


@hookspec(firstresult=True)
def zoo_tensor_parallel_split(name: str, description: "ModelDescription", rank: int,
                              world: int) -> tuple[int, int, int] | str | None:
    """How one rank of a tensor-parallel split holds the parameter ``name`` of a module this plugin added.

    Returns ``(dim, first, length)`` (the slice of the whole tensor along ``dim``), ``"whole"`` (every rank holds
    all of it) or ``"zeros"`` (a bias the all-reduce adds once, from rank 0). None: the core's rule
    (:func:`zoo.parallel.shard_of`: the Llama layout's projections, embedding and LM head, everything else
    whole). Only parameters of shapes the plugin builds from the rank's description need one.
    """


@hookspec
def zoo_model_build(model: "DecoderModel", description: "ModelDescription") -> None:
    """Add modules whose weights the checkpoint holds, before the weights load.

    Runs once, right after the generic model is built (its tensors not yet
    allocated): attach an embedding table or a vision encoder, or replace
    ``model.model.rotary`` (:class:`zoo.model.Rotary`, the extension point for
    position layouts and scaled RoPE). Weights named after the added modules'
    parameter paths load like the model's own.
    """


@hookspec
def zoo_model_modify(model: "DecoderModel", description: "ModelDescription", config: Any) -> None:
    """Wrap or add modules after the weights are loaded.

    Runs once, before q/k/v and gate/up are fused. Wrap a projection in a
    :class:`zoo.model.LinearWrapper` (its ``delta`` is added to the fused
    product, so fusion stays on), attach heads, load adapter weights. Modules
    read per-step tensors from :func:`zoo.forward_context.get_forward_context`
    while the model runs, so nothing per-step is needed here. ``config`` is the
    whole run config.
    """


# ----------------------------------------------------------------------------
# Engine start: the model runner exists, the KV cache is about to be sized
# ----------------------------------------------------------------------------


@hookspec
def zoo_engine_start(engine: "Engine", setup: "EngineSetup") -> None:
    """Allocate what the plugin needs for the whole run.

    Runs once, after the model and the model runner exist and before the KV
    cache is sized, the memory-profile step runs and CUDA graphs are captured,
    so that what plugins add counts in the memory budget and is captured:
    ``setup.add_buffer(BufferSpec)`` (a static per-step tensor, cut to each
    step's size and handed to ``zoo_step_prepare`` and the forward context),
    ``setup.add_kv_layers(modules)`` (attention modules of a draft model get
    cache layers from the same block pool: the same block tables and slots as
    the model's own layers), ``setup.capture_layers(indices)`` (step results
    carry these decoder layers' outputs), ``setup.run_eagerly_when(when)``
    (steps for which ``when(scheduled)`` holds never replay a CUDA graph: for
    work in the model that reads the step's requests). Returns nothing.
    """


@hookspec
def zoo_decoding_methods() -> dict[str, Callable[["Engine"], "DecodingMethod"]]:
    """Register decoding methods by name.

    Runs once at engine start, after the checkpoint is described and before its
    weights load. Returns ``{name: factory}``; ``decoding=NAME`` picks exactly
    one, built as ``factory(engine)`` (a :class:`zoo.decoding.DecodingMethod`):
    ``engine.config``, ``engine.description``, ``engine.device`` and
    ``engine.dtype`` are set, ``engine.model`` is not yet, so the factory checks
    settings and reads files, and the method touches the model in its own
    ``zoo_engine_start``. Contribute; a name registered twice is an error, and
    so is a ``decoding`` option no plugin registers.
    """


@hookspec
def zoo_adapter_kinds() -> dict[str, Callable[["Engine"], "AdapterKind"]]:
    """Serve adapters of some PEFT types.

    Runs at engine start, before the weights load. Returns ``{peft_type:
    factory}`` (``{"LORA": LoRA}``); the factory takes the engine and returns a
    :class:`zoo.adapters.AdapterKind`, which loads the adapters of that type
    and is registered as a plugin, so its hook implementations run too.
    Contribute; a type served twice is an error.
    """


# ----------------------------------------------------------------------------
# Requests: when a request enters the engine
# ----------------------------------------------------------------------------


@hookspec
def zoo_request_fields() -> list[str]:
    """Name the request fields this plugin reads.

    Runs at engine start. Returns field names (``images``, ``adapter``...) that a
    JSONL record or request dict may carry besides the prompt, ``id`` and
    sampling keys; they reach plugins in ``request.extras``. A field no plugin
    names rejects the request. Contribute.
    """


@hookspec
def zoo_prompt_transform(request: "Request", description: "ModelDescription") -> None:
    """Rewrite a request's prompt before it is checked.

    Runs once per request, after tokenization and before validation: change
    ``request.prompt_token_ids`` in place (prompt tuning prepends its virtual
    tokens; Qwen2-VL gives each image as many pad tokens as it has merged
    patches, as its processor does). The rewritten prompt is what counts
    against ``max_model_len`` and the KV cache; ``request.input_token_ids``
    keeps what the user sent, for the output. Raise ``zoo.RequestError`` to
    reject the request.
    """


@hookspec(firstresult=True)
def zoo_request_table_size(request: "Request") -> int | None:
    """How many ids past the vocabulary this request's prompt may hold.

    Runs once per request, before the core checks its token ids. Id
    ``vocab_size + i`` stands for row ``i`` of a per-request embedding table
    that the plugin writes in ``zoo_embed_modify`` (TensorRT-LLM's prompt
    table; prompt tuning's virtual tokens). firstresult; default 0.
    """


@hookspec
def zoo_request_validate(request: "Request", description: "ModelDescription") -> str | None:
    """Check a request before it is admitted.

    Runs once per request, after the core's own checks. Returns an error
    message to reject the request with ``finish_reason: error``, or ``None``.
    Contribute: every message is reported.
    """


@hookspec(firstresult=True)
def zoo_request_bidirectional_prefix(request: "Request") -> int | None:
    """How many leading tokens attend to each other in both directions (a prefix-LM).

    Runs once per accepted request. GLM's context returns ``len(prompt) - 1``.
    The core computes such a prefix in one step, masks attention accordingly
    and keys cached blocks on the whole prefix. firstresult; default 0.
    """


@hookspec
def zoo_request_cache_key(request: "Request") -> Hashable | None:
    """A part of the prefix-cache key: what besides the tokens changes this request's K/V.

    Runs once per accepted request. Return a hashable value (an adapter's name,
    a digest of the images), or ``None`` when the K/V depend on the tokens
    alone. Contribute: the parts of all plugins (and the core's bidirectional
    prefix) compose one key, and cached blocks are shared only between requests
    whose keys are equal.
    """


@hookspec
def zoo_request_admit(request: "Request", engine: "Engine") -> None:
    """Set up per-request state when a request is accepted.

    Runs once per request, after validation. Store state in
    ``request.plugin_state[<plugin name>]``; ``request.finish("error", msg)``
    rejects it.
    """


# ----------------------------------------------------------------------------
# Steps: one forward pass
# ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def zoo_step_positions(request: "Request", indices: list[int],
                       description: "ModelDescription") -> list[list[int]] | None:
    """Give the position ids of some of a request's tokens.

    Runs for each request in each step. ``indices`` are token indices (0-based
    over prompt plus generated tokens; a draft token at position offset ``d``
    asks for ``num_tokens - 1 + d``). Returns ``description.position_rows``
    lists, each ``len(indices)`` long. firstresult; default: the index (one row).
    """


@hookspec
def zoo_step_prepare(batch: "StepBatch", buffers: dict[str, "torch.Tensor"]) -> None:
    """Fill the plugin's buffers for one step.

    Runs once per step after the core has filled its own. ``buffers`` maps every
    buffer name to a view of the step's size: write into the views
    (``copy_``), never replace them. Lay per-token values out with
    ``batch.per_token`` (a verify step replayed as a CUDA graph pads every
    request to the same number of rows). On CUDA the engine first runs one
    full-size step of dummy requests (negative ``request_id``) to measure
    memory; plugins see it like any other step.
    """


@hookspec
def zoo_embed_modify(hidden: "torch.Tensor", context: "ForwardContext", model: "DecoderModel") -> None:
    """Change the input embeddings of a step in place.

    Runs inside the forward pass, after the token (and learned position)
    embeddings. ``hidden`` is ``[num_tokens, hidden_size]``. Also recorded into
    CUDA graphs, where ``context.batch`` is ``None``: read per-step data from
    ``context.buffers`` with tensor operations only. Prompt steps replay graphs
    too; work that needs the step's requests must keep its steps eager with
    ``setup.run_eagerly_when`` (see ``zoo_engine_start``).
    """


@hookspec
def zoo_logits_process(logits: "torch.Tensor", requests: list["Request"], histories: Sequence[list[int]],
                       engine: "Engine") -> None:
    """Adjust next-token logits before sampling, in place.

    Runs after the core's processors. ``logits`` is ``[rows, vocab]`` float32,
    one row per entry of ``requests``; ``histories[i]`` is the token sequence
    row ``i`` follows (with draft tokens accepted earlier in the step), built
    only when read.
    """


@hookspec
def zoo_step_results(results: "StepResults") -> None:
    """See what a step produced, to propose the next drafts.

    Runs after each step's tokens are committed. ``results.sequences`` has, for
    each request the step advanced, the tokens committed and the rows of the
    tokens whose K/V it kept; ``results.hidden_states(rows)`` and
    ``results.layer_states(layer, rows)`` gather final or captured-layer
    hidden states on the device (valid until the next step). Nothing is copied
    to the host unless a plugin does it.
    """


# ----------------------------------------------------------------------------
# Tokens: after each generated token
# ----------------------------------------------------------------------------


@hookspec
def zoo_token_generated(request: "Request", token_id: int) -> bool | None:
    """See each generated token as soon as it is committed.

    Runs once per token per request. Return ``True`` to finish the request
    with ``finish_reason: stop``. Contribute.
    """


@hookspec
def zoo_request_finished(request: "Request") -> None:
    """Release per-request state.

    Runs once for every request that ends: finished, stopped, or rejected at
    any point of admission (then ``request.error`` says why).
    """
