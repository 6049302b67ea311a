"""Every hook zoo calls, in the order a run meets them.

Hook names are ``zoo_<stage>_<verb>``. "Contribute" hooks collect a result from
every plugin and the core merges them; ``firstresult`` hooks ask for one answer
and stop at the first plugin that returns something other than ``None``.
Implementations may take fewer arguments than the spec lists, so specs can grow
without breaking plugins (pluggy passes arguments by name).

Plugins mark implementations with ``zoo.hookimpl``.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("zoo")

# ----------------------------------------------------------------------------
# Configuration: before Hydra composes the config
# ----------------------------------------------------------------------------


@hookspec
def zoo_config_register(config_store):
    """Add options to Hydra config groups.

    Runs once when ``python -m zoo.run`` starts, before Hydra composes the
    config. ``config_store`` is Hydra's ``ConfigStore``; call
    ``config_store.store(group="processor", name="my_option", node={...})`` to
    make ``processor=my_option`` selectable. Returns nothing.
    """


# ----------------------------------------------------------------------------
# Model: architecture, modules and weights
# ----------------------------------------------------------------------------


@hookspec
def zoo_model_architectures():
    """Name the HF architectures this plugin can build.

    Runs when a checkpoint is opened. Returns ``{architecture_name: describe}``
    where ``describe(hf_config: dict) -> zoo.ModelDescription`` turns a
    ``config.json`` into the generic transformer's description (raise
    ``zoo.ZooError`` for settings it cannot honour). Contribute: the core
    merges all dicts; two plugins claiming one name is an error.
    """


@hookspec(firstresult=True)
def zoo_weights_convert(description, name, tensor):
    """Map one checkpoint tensor onto zoo's parameter names.

    Runs for every tensor of the checkpoint, before it is copied into the
    model. Receives the model's ``description``, the checkpoint tensor
    ``name`` and the lazily loaded ``tensor``. Returns a list of
    ``(zoo_name, tensor)`` pairs (empty to skip the tensor; several to split a
    fused weight), or ``None`` when the plugin does not handle this
    architecture. firstresult. With no answer the name is used as is.
    """


@hookspec
def zoo_model_build(model, description):
    """Add modules whose weights the checkpoint holds, before the weights load.

    Runs once, right after the generic model is built (its tensors not yet
    allocated) and before the checkpoint is read: attach an extra embedding
    table, a vision encoder, or replace ``model.model.rotary`` with a module
    for another position layout. Check ``description.architecture`` first:
    every plugin sees every model. Weights named after the added modules'
    parameter paths load like the model's own. Returns nothing.
    """


@hookspec
def zoo_model_modify(model, description, config):
    """Wrap or add modules after the model is built and loaded.

    Runs once, after the weights are loaded and before the KV cache is sized.
    ``model`` is the :class:`zoo.model.DecoderModel`; modify it in place
    (swap a Linear for an adapter-aware one, attach draft heads, replace the
    rotary module). ``config`` is the whole run config. Returns nothing.
    """


# ----------------------------------------------------------------------------
# Static buffers: declared once, allocated once, filled every step
# ----------------------------------------------------------------------------


@hookspec
def zoo_buffers_declare(description, limits):
    """Declare extra per-step tensors with their largest shapes.

    Runs once when the model runner starts. ``limits`` is a
    :class:`zoo.model_runner.RunnerLimits` (max tokens per step, max
    sequences, max blocks per sequence). Returns a list of
    :class:`zoo.model_runner.BufferSpec`; the core allocates each once on the
    model's device and hands views of them to ``zoo_step_prepare`` and the
    model every step, so decode steps can replay as CUDA graphs. Contribute.
    """


# ----------------------------------------------------------------------------
# Requests: when a request enters the engine
# ----------------------------------------------------------------------------


@hookspec
def zoo_request_fields():
    """Name the request fields this plugin reads.

    Runs when the engine starts. Returns a list of field names (``images``,
    ``adapter``...) that a JSONL record or request dict may carry besides
    the prompt, ``id`` and sampling keys; they reach the plugin in
    ``request.extras``. A field no plugin names rejects the request, so a
    misspelt key is an error instead of being ignored. Contribute.
    """


@hookspec
def zoo_request_validate(request, description):
    """Check a request before it is admitted.

    Runs once per request, after the core's own checks. Returns an error
    message (``str``) to reject the request with ``finish_reason: error``, or
    ``None``. Contribute: every message is reported.
    """


@hookspec
def zoo_request_admit(request, engine):
    """Set up per-request state when a request is accepted.

    Runs once per request, after validation. Store state in
    ``request.plugin_state[<plugin name>]`` (precomputed position rows, image
    features, the adapter id). Returns nothing.
    """


# ----------------------------------------------------------------------------
# Steps: building the inputs of one forward pass
# ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def zoo_step_positions(request, indices, description):
    """Give the position ids of some of a request's tokens.

    Runs for each request in each step. ``indices`` are the token indices of
    the request (0-based over prompt plus generated tokens; a draft token at
    tree depth ``d`` asks for index ``num_tokens - 1 + d``). Returns a list of
    ``description.position_rows`` lists, each ``len(indices)`` long, or
    ``None`` to leave it to the next plugin. firstresult; the core's default
    is the index itself (one row). When no plugin answers for a request's
    first step, the request keeps the default and is not asked about again.
    """


@hookspec
def zoo_step_prepare(batch, buffers):
    """Fill the plugin buffers for one step.

    Runs once per step after the core has filled its own buffers.
    ``batch`` is the :class:`zoo.model_runner.StepBatch` (the scheduled
    requests, their token ranges and drafts); ``buffers`` maps every buffer
    name to a view of the step's size. Write into the views (``copy_``),
    never replace them. On CUDA the engine first runs one full-size step of
    dummy requests (negative ``request_id``, all-zero tokens) to measure
    memory; plugins see it like any other step. Returns nothing.
    """


@hookspec
def zoo_embed_modify(hidden, batch, buffers, model):
    """Change the input embeddings of a step in place.

    Runs inside the model's forward, after the token (and learned position)
    embeddings, before the first layer. ``hidden`` is ``[num_tokens,
    hidden_size]``; write into it (virtual tokens, image features, a second
    position embedding). ``model`` is the running :class:`zoo.model.DecoderModel`,
    to reach modules added in ``zoo_model_build``. Returns
    nothing. On CUDA this hook is also recorded into the decode CUDA graphs,
    with ``batch=None``: read per-step data from ``buffers`` with tensor
    operations only, so that each replay sees the step's values.
    """


@hookspec
def zoo_output_collect(hidden, batch, buffers):
    """Keep extra outputs of a forward pass.

    Runs after the final norm, before the LM head. ``hidden`` is
    ``[num_tokens, hidden_size]``. Returns a dict merged into
    ``StepOutput.extras`` (for example the hidden states a draft head
    needs), or ``None``. Contribute. Recorded into the decode CUDA graphs
    like ``zoo_embed_modify`` (``batch=None``); the tensors returned then are
    the graph's outputs, refreshed by every replay.
    """


@hookspec
def zoo_logits_process(logits, requests, histories, engine):
    """Adjust next-token logits before sampling, in place.

    Runs after the core's own processors (repetition penalty, logit bias,
    min tokens). ``logits`` is ``[num_rows, vocab]`` float32 with one row per
    entry of ``requests``; ``histories[i]`` is the token sequence row ``i``
    follows (prompt, generated tokens, and any draft tokens accepted earlier
    in the same step, so it can be longer than ``request.token_ids``).
    ``histories`` is a sequence that builds each list when it is read, so a
    plugin that needs no history costs nothing per row. Returns nothing.
    """


# ----------------------------------------------------------------------------
# Decoding: speculative and multi-token methods
# ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def zoo_decoding_propose(requests, engine):
    """Propose draft tokens for the running requests.

    Runs before each step that has requests in decode. Returns
    ``{request_id: zoo.DraftTree}`` (tokens plus parent indices: a chain or
    a tree), or ``None`` for plain decoding. The core schedules the last
    committed token plus the drafts as query tokens of one step, with the
    tree as attention mask. firstresult.
    """


@hookspec(firstresult=True)
def zoo_decoding_verify(request, draft, logits, sampler):
    """Choose which draft tokens to keep.

    Runs for each request that carried a draft, after the forward pass.
    ``logits`` are ``[1 + len(draft), vocab]``: row 0 after the last
    committed token, row ``1 + i`` after draft token ``i``. Returns
    ``(accepted_draft_indices, next_token)``; the core keeps those draft
    tokens plus ``next_token`` and rolls the KV cache back for the rest.
    firstresult; the core's default accepts the longest path whose tokens
    equal what the sampler picks.
    """


# ----------------------------------------------------------------------------
# Tokens: after each generated token
# ----------------------------------------------------------------------------


@hookspec
def zoo_token_generated(request, token_id):
    """See each generated token as soon as it is committed.

    Runs once per token per request (streaming, custom stop rules). Return
    ``True`` to finish the request with ``finish_reason: stop``. Contribute.
    """


@hookspec
def zoo_request_finished(request):
    """Release per-request state when a request finishes or is rejected."""
