"""Activation offload on one device (``--offload activations``): which saved tensors leave the GPU.

The mechanism is torchtune's ``OffloadActivations`` (torchtune/training/_activation_offloading.py
at bd2a0fc, defaults ``use_streams=True``, ``max_fwd_stash_size=5``, ``min_offload_size=1024``)
as ``get_act_offloading_ctx_manager`` installs it: a ``saved_tensors_hooks`` pair around the
model's forward, turned off (``NoOpManager``) inside the output projection, with the loss
computed outside it (recipes/full_finetune_single_device.py ``_loss_step``). Its pack hook copies
each saved tensor of at least 1024 bytes that is not an ``nn.Parameter`` to host memory; autograd
then holds an id, and the device copy dies with its last Python reference. The tracer runs the
same policy (``trace/offload.py``); ``tests/estimate/test_activation_offload.py`` holds the two,
and a real-tensor run, to the same bytes.

Rules, per saved tensor (one estimator item, one storage), in the order applied:

* ``B·S·8`` int64 token ids (``*.indices``): copied to host, but the caller's tensor stays;
* fewer than 1024 bytes (``rsqrt`` of a norm at small B·S, scalars): kept on the device;
* kept by the LM head or the loss (outside the offloaded region): kept;
* a frozen embedding's output under recompute (fine-tuning): HF's ``enable_input_require_grads``
  makes it a leaf that requires grad, held by the graph itself (packed copies go to host too): kept;
* a checkpointed block's input other than the first: Hugging Face's
  ``GradientCheckpointingLayer`` passes only the hidden state positionally
  (transformers/modeling_layers.py: ``checkpoint(partial(forward, **kwargs), *args)``) and
  ``torch.utils.checkpoint`` packs only positional inputs (``_CheckpointFrame.save_inputs``); the
  keyword arguments (position embeddings, position ids, mask) live in the recompute closure;
* ``--recompute op``: what the SAC policy saves (kept at the block's scope, no position) stays in
  ``_CachingTorchDispatchMode``'s cache, inside the checkpoint's own (innermost) hooks: kept;
* ``--recompute selective``: the attention checkpoint's ``position_ids`` (a keyword): kept; q, k, v go;
* ``--recompute every-k``: a checkpoint's kept keyword input that an eager block also saves (the
  rotary cos/sin) is copied to host as well;
* everything else: offloaded. Under full recompute that is each block's input hidden state.
  Under per-block ``--compile`` it is what each compiled block's partition saves (Python hooks are
  not inlined: ``CompiledFunction`` saves through ``ctx.save_for_backward``), plus, under full
  recompute on CPU, each block's generator state (:func:`_generator_states`).

With streams, the device copy of each offloaded tensor is kept in a forward stash; each new
offloaded pack releases the entries five or more packs older. At the end of forward the stash holds
the offloaded packs among the last five ending at the last offloaded one. For an RMSNorm (six packs:
x, its rsqrt, x and rsqrt again, the weight, the normalized x) and for a LayerNorm whose mean and
rstd are offloaded (input, weight, bias, mean, rstd) those five are the final norm's own, so
``stash`` is the final norm's offloaded tensors. An RMSNorm with a frozen weight (LoRA) packs no
normalized x: its last offloaded pack is its fourth, and the window takes the last block's last pack
too (:func:`_block_packs_in_stash`). They stay through the loss backward until the first node that
brings a tensor back runs.

In backward each node's offloaded tensors come back as new device tensors and stay until the
next such node has run (``in_flight``, with ``X`` the block's largest offloaded tensor and ``W`` its
largest weight):

* without recompute, a gated MLP's product backward (``act_fn(gate) * up``) is the widest moment:
  its two saved inputs and the down projection's (``3·X``) are on the device with the product's
  input gradient and its two output gradients (``3·X``, one of which the phases' work term already
  counts), plus a weight copy ``W`` (a linear layer saves ``weight.t()``, a view that is not an
  ``nn.Parameter``, so torchtune copies it out and back too): ``5·X + W``. A two-matrix MLP's
  activation backward has one saved input beside the down projection's and two gradients:
  ``3·X + W``, with ``W = 0`` for GPT-2's ``Conv1D``, whose ``addmm`` saves the Parameter itself
  (under autocast it saves a cast copy, which is copied);
* under full recompute only each block's input hidden state is packed (the recompute's own hooks
  take the block's saves): this block's and the previous block's, ``2·X``;
* per-block compile: one backward node per block brings the block's whole offloaded set back,
  held until the next block's node has run: two blocks' sets.

Known limitations:
  - ``host_bytes`` counts each offloaded storage once; torchtune copies every pack (a tensor
    saved by three projections three times, and the weights' views): the tracer's host figure
    is larger (both are reported).
  - a LayerNorm whose mean and rstd stay (under 1024 bytes each: B·S < 256 rows in fp32, < 512
    in bf16) leaves room in the window for the last block's last packs, which the stash then
    holds too and the estimate does not count (GPT-2 bf16, B·S = 256: 196608 bytes, not 32768);
  - profiles other than ``hf`` are not modelled (their head and checkpoint naming differ);
  - ``in_flight`` is the eager bound under every-k (mixed blocks) and leaves out a compiled block's
    own backward working set: the step peak is off there (docs/offload.md has the ratios).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.names import is_embedding, is_embedding_indices

__all__ = ["OffloadSplit", "offload_split", "MIN_OFFLOAD_BYTES", "outside_region"]

MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)


def outside_region() -> tuple[str, ...]:
    """Scopes whose saves torchtune leaves on the device: the output projection (NoOpManager) and the
    loss (computed outside the context): the registry's output modules (``lm_head``, BERT's ``cls``,
    ``loss``, the task heads ``score``/``classifier``)."""
    from trainmem.families import output_modules
    return output_modules()


@dataclass(frozen=True)
class OffloadSplit:
    """Saved activations split by where they live (bytes: logical, one storage each)."""

    device: Inventory
    """Saved tensors that stay on the device."""
    host: Inventory
    """Saved tensors copied to host memory ("offloaded to host"); their device copies die."""
    stash_bytes: int
    """Device copies the forward stash still holds when backward starts."""
    in_flight_bytes: int
    """Bound on the tensors brought back and alive at once in backward (two nodes' worth)."""
    reasons: dict[str, str]
    """Why each kept item stays on the device (item name -> reason)."""

    @property
    def host_bytes(self) -> int:
        return self.host.total()


def _is_block(scope: str) -> bool:
    """A decoder block's own scope (``model.layers.3``): where a whole-block checkpoint closes."""
    from trainmem.names import layer_of
    return layer_of(scope + ".x") is not None and scope.rsplit(".", 1)[-1].isdigit()


def _stays(it: MemoryItem, keeper: tuple[str, int | None], B: int, S: int, sac: bool = False) -> tuple[bool, str]:
    """(stays on the device, reason) for one item; an input of the step is also copied out."""
    scope, position = keeper
    if it.dtype == "int64" and it.shape == (B, S) and is_embedding_indices(it.name):
        return True, "the caller's token ids (torchtune copies them out too)"
    if it.bytes < MIN_OFFLOAD_BYTES:
        return True, f"smaller than min_offload_size ({MIN_OFFLOAD_BYTES} bytes)"
    if not scope or scope.split(".")[0] in outside_region():
        return True, "kept by the output projection or the loss (outside the offloaded region)"
    if position is not None and position > 0 and _is_block(scope):
        return True, "a checkpointed block's keyword input (held by the recompute closure)"
    if position is not None and not _is_block(scope) and it.name.endswith("position_ids"):
        # --recompute selective (trace/step.py _selective_recompute): the attention call passes q, k, v
        # and the mask positionally, position_ids among **kwargs (modeling_llama.py LlamaAttention.forward)
        return True, "the checkpointed attention's keyword input (held by the recompute closure)"
    if sac and position is None and _is_block(scope):
        # --recompute op: an output the policy saves (estimate/graph.py Graph.checkpoint) is stored by
        # torch/utils/checkpoint.py _CachingTorchDispatchMode inside the checkpoint's own
        # saved_tensors_hooks (_checkpoint_hook), which are innermost: torchtune's hooks never see it
        return True, "kept by selective checkpointing's cache (inside the checkpoint's own hooks)"
    if scope and is_embedding(scope + ".weight") and not is_embedding_indices(it.name):
        # a frozen embedding's output under recompute (estimate/rules_hf_parts.py _embedding): HF's
        # enable_input_require_grads makes it a leaf, which the graph's AccumulateGrad holds itself;
        # not the indices an embedding saves (GPT-2's position ids, made in forward: copied out, freed)
        return True, "a leaf the graph holds (enable_input_require_grads), not a packed tensor"
    return False, ""


def offload_split(acts: Inventory, keepers: dict[str, tuple[str, int | None]], *, B: int, S: int,
                  largest_block_weight_bytes: int, checkpointed: bool = False, gated: bool = True,
                  compiled: bool = False, use_streams: bool = True,
                  packed_elsewhere: frozenset[str] = frozenset(), sac: bool = False,
                  linear_weights: frozenset[str] = frozenset(), rmsnorm: bool = False) -> OffloadSplit:
    """Split ``acts`` (an activation inventory, templates per block) by torchtune's policy.
    ``keepers``: item name -> (scope that kept it, position among a checkpoint's inputs).
    ``packed_elsewhere``: kept items an unchecked block also saves (--recompute every-k: the
    rotary ``cos``/``sin`` a checkpoint's closure holds and an eager block's RoPE packs), which
    are copied to host as well. ``sac``: --recompute op, whose policy's outputs stay in its cache.
    ``linear_weights``: the blocks' 2-D weight names (which scopes are linear layers, for the stash);
    ``rmsnorm``: the final norm is a Llama-style RMSNorm (its pack order, :func:`_block_packs_in_stash`)."""
    dev_base, host_base, reasons = [], [], {}
    copied_inputs = []
    for it in acts.base:
        stays, why = _stays(it, keepers.get(it.name, ("", None)), B, S, sac)
        (dev_base if stays else host_base).append(it)
        if stays:
            reasons[it.name] = why
            if why.startswith(_PACKED_AND_KEPT) or (it.name in packed_elsewhere and it.bytes >= MIN_OFFLOAD_BYTES):
                copied_inputs.append(it)
    dev_reps, host_reps = [], []
    for r in acts.repeats:
        keep = [it for it in r.items if _stays(it, keepers.get(it.name, ("", None)), B, S, sac)[0]]
        off = [it for it in r.items if it not in keep]
        for it in keep:
            reasons[it.name] = _stays(it, keepers.get(it.name, ("", None)), B, S, sac)[1]
        dev_reps.append(_replace_items(r, keep))
        host_reps.append(_replace_items(r, off))
    host = Inventory(host_base + copied_inputs, host_reps)
    stash = 0
    out_base = [it for it in host_base if it not in copied_inputs]  # outside blocks, in forward order
    if use_streams and out_base:  # the final norm's offloaded tensors (see the module docstring)
        last_scope = keepers.get(out_base[-1].name, ("", None))[0]
        norm = [it for it in out_base if keepers.get(it.name, ("", None))[0] == last_scope]
        stash = sum(it.bytes for it in norm) + (0 if compiled else _block_packs_in_stash(
            norm, acts, host, keepers, checkpointed, linear_weights) if rmsnorm else 0)  # a compiled block's pack order: not modelled
    block = max((it.bytes for r in host.repeats for it in r.items), default=0) or max(
        (it.bytes for it in out_base), default=0)
    if compiled and not checkpointed:  # one backward node per compiled block unpacks its whole saved set,
        # held until the next block's node has run: this block's and the previous one's
        in_flight = 2 * max(_per_block(host).values(), default=0)
    elif checkpointed:  # a block's input comes back; the previous block's stays until this one's hook
        in_flight = 2 * block
    elif gated:  # the MLP product's node: its two saved inputs and the down projection's, three gradients
        in_flight = 5 * block + largest_block_weight_bytes  # (one is the phases' work) and a weight copy
    else:  # the activation's node: its saved input and the down projection's, two gradients
        in_flight = 3 * block + largest_block_weight_bytes
    return OffloadSplit(Inventory(dev_base, dev_reps), host, stash, in_flight, reasons)


#: kept items torchtune's pack hook copies all the same (it checks size and Parameter-ness only): the caller's
#: ids, and a frozen embedding's output under recompute (a leaf the graph holds; its checkpoint packs it)
_PACKED_AND_KEPT = ("the caller", "a leaf the graph holds")


def _kept_by_linear(scope: str, weights: frozenset[str]) -> bool:
    """``scope`` is a linear layer: a base model's (its 2-D weight in ``weights``) or a peft adapter's."""
    return f"{scope}.weight" in weights or ".lora_B." in f"{scope}."


def _block_packs_in_stash(norm: list[MemoryItem], acts: Inventory, host: Inventory,
                          keepers: dict[str, tuple[str, int | None]], checkpointed: bool,
                          weights: frozenset[str]) -> int:
    """The last block's offloaded tensor still in the forward stash at the end of the forward.

    torchtune's ``pack_tensor`` (torchtune/training/_activation_offloading.py) numbers every pack, kept ones
    included, and an offloaded pack releases the stash entries ``max_fwd_stash_size`` (5) or more packs older;
    the stash then holds the offloaded packs among the five ending at the last offloaded one. A Llama RMSNorm
    (modeling_llama.py ``LlamaRMSNorm.forward``) packs its fp32 input (``pow``), ``rsqrt`` (its own node),
    ``rsqrt`` and the fp32 input again (``x * rsqrt``: ``other`` is packed before ``self``), the weight, and the
    normalized ``h`` only when the weight trains (``weight * h``: derivatives.yaml saves ``self`` for
    ``other``'s gradient). With a frozen weight (LoRA) only its input (``x_fp32``, or in fp32 the block's
    output itself) and ``rsqrt`` go out, and the norm's last offloaded pack is its fourth, so the window takes
    the last block's last pack:

    * a checkpointed block packs only its positional input (torch/utils/checkpoint.py ``_CheckpointFrame.
      save_inputs``; the keyword inputs stay in the closure): the last block's input;
    * an eager block ends on its last linear's ``mm``. A trained weight's (a peft ``lora_B``'s, or the plain
      linear's under ``--freeze``) packs ``weight.t()`` and then its input (the order read off the real hooks,
      tests/estimate/test_offload_adapters.py): that input, the block's last saved item, kept by the linear.
      A frozen one packs only ``weight.t()``, a view of a Parameter with no device bytes of its own: 0."""
    from trainmem.names import layer_of
    if len([it for it in norm if not it.name.endswith(".rsqrt")]) != 1:
        return 0  # the normalized h went out too: the window ends inside the final norm
    offloaded = {it.name for it in host}
    items = list(acts)
    if checkpointed:
        inputs = {layer_of(keepers[it.name][0] + ".x"): it for it in items if it.name in keepers
                  and keepers[it.name][1] == 0 and _is_block(keepers[it.name][0])}
        tail = [inputs[max(inputs)]] if inputs else []
    else:
        last = max((layer_of(it.name) for it in items if layer_of(it.name) is not None), default=None)
        block = [it for it in items if it.bytes and layer_of(keepers.get(it.name, ("", None))[0] + ".x") == last]
        # (the block: in fp32 its output is the final norm's input, kept by the norm)
        tail = block[-1:] if block and _kept_by_linear(keepers.get(block[-1].name, ("", None))[0], weights) else []
    return sum(it.bytes for it in tail if it.name in offloaded)


def _per_block(host: Inventory) -> dict[int, int]:
    """Offloaded bytes per decoder block (layer index -> bytes)."""
    from trainmem.names import layer_of
    out: dict[int, int] = {}
    for it in host:
        li = layer_of(it.name)
        if li is not None:
            out[li] = out.get(li, 0) + it.bytes
    return out


def _replace_items(r, items):
    from dataclasses import replace
    return replace(r, items=tuple(items))


def activation_offload(model, step, impl, *, use_streams: bool = True, finetune=None) -> OffloadSplit:
    """:func:`offload_split` of the step's activation inventory (identical blocks stored once;
    with ``finetune``, every block its own, the frozen, 4-bit and LoRA linears' saves as
    ``estimate/finetune.py`` has them: torchtune offloads LoRA and QLoRA recipes the same way)."""
    from trainmem.errors import SpecError
    from trainmem.estimate.activations import _forward, _input_ids
    from trainmem.estimate.ctx import Ctx
    from trainmem.estimate.graph import Graph
    from trainmem.estimate.params import parameter_shapes
    from trainmem.families import family_of
    from trainmem.inventory import dtype_bytes
    from trainmem.names import layer_of
    from dataclasses import replace

    if impl.profile != "hf":
        raise SpecError("offload", "activations", f"is modelled under --profile hf only, not {impl.profile!r}")
    if impl.compile and impl.compile_scope == "model":  # torchtune compiles each layer (training.compile_model)
        raise SpecError("offload", "activations", "is modelled with --compile-scope block or block-loss (torchtune "
                                                  "compiles each layer), not model")
    ctx = Ctx(Graph(), model, step, impl, replicate=finetune is None)
    if finetune is not None:
        from trainmem.estimate.finetune import FinetuneLinear, trainable_predicate
        if finetune.mode == "qlora" and finetune.quant_impl == "bnb-legacy":
            raise SpecError("offload", "activations", "is not modelled with quant_impl bnb-legacy (its held "
                                                      "inputs bypass the saved-tensor hooks)")
        ctx.trainable = trainable_predicate(model, finetune)
        ctx.finetune_linear = FinetuneLinear(model, step, finetune)
    _input_ids(ctx)
    _forward(impl)(ctx)
    keepers = {it.name: k for it, k in zip(ctx.graph.items(), ctx.graph.keepers())}
    notes = []
    if finetune is not None:  # a frozen embedding's zero-byte ids marker, as estimate/activations.py adds it
        before = len(ctx.finetune_linear.notes)  # (estimate/phase_parts.py caller_ids: the caller holds the ids)
        ctx.finetune_linear.embedding_notes(ctx, model)
        notes = ctx.finetune_linear.notes[before:]
    packed_elsewhere = frozenset()
    if impl.recompute == "every-k" and not _all_blocks_checkpointed(model, impl):  # eager blocks save them too
        eager = Ctx(Graph(), model, step, replace(impl, recompute="none", recompute_every=1),
                    replicate=finetune is None)
        eager.trainable, eager.finetune_linear = ctx.trainable, ctx.finetune_linear
        _input_ids(eager)
        _forward(eager.impl)(eager)
        packed_elsewhere = frozenset(it.name for it, (scope, _) in zip(eager.graph.items(), eager.graph.keepers())
                                     if layer_of(scope + ".x") is not None)
    # the copies are made from the compute weights: the parameters, or autocast's casts of them
    size = dtype_bytes(step.dtypes.activation if step.dtypes.autocast else step.dtypes.param)
    linear = {name: shape for name, shape in parameter_shapes(model) if layer_of(name) is not None and len(shape) == 2}
    weight = max((int(math.prod(shape) * size) for shape in linear.values()), default=0)
    if family_of(model).conv1d and not step.dtypes.autocast:
        weight = 0  # Conv1D's addmm saves the Parameter itself, which torchtune never copies
    split = offload_split(ctx.graph.inventory(), keepers, B=step.batch, S=step.seq,
                         largest_block_weight_bytes=weight, checkpointed=_all_blocks_checkpointed(model, impl),
                         gated=model.gated, compiled=impl.compile,
                         use_streams=use_streams, packed_elsewhere=packed_elsewhere, sac=impl.recompute == "op",
                         linear_weights=frozenset(linear),
                         rmsnorm=model.norm == "rmsnorm" and not family_of(model).rules.unit_offset_norm)
    if impl.compile and impl.recompute == "full" and impl.device == "cpu":
        split = replace(split, host=split.host + Inventory(_generator_states(model)))
    return replace(split, device=split.device + Inventory(notes)) if notes else split


CPU_GENERATOR_STATE_BYTES = 5056
"""``torch.get_rng_state().nbytes()``: the CPU generator's mt19937 state (aten/src/ATen/CPUGeneratorImpl.cpp
``CPUGeneratorImplState``). CUDA's Philox state (``torch.cuda.get_rng_state()``: seed and offset) is 16
bytes, under ``min_offload_size``."""


def _generator_states(model) -> list[MemoryItem]:
    """A compiled checkpointed block saves the generator state its recomputed SDPA replays
    (estimate/rules_compiled.py ``_checkpointed_layers``): a host tensor, which torchtune's pack hook
    copies all the same (it checks size and Parameter-ness, not the device), host to host."""
    return [MemoryItem(name=f"model.layers.{i}.rng_state", category=Category.ACTIVATION,
                       shape=(CPU_GENERATOR_STATE_BYTES,), dtype="uint8", bytes=CPU_GENERATOR_STATE_BYTES,
                       formula="torch.get_rng_state()", note="host memory already; copied by the pack hook")
            for i in range(model.num_layers)]


def _all_blocks_checkpointed(model, impl) -> bool:
    """Every block under a whole-block checkpoint (full, op, every-k with k = 1): backward brings
    back block inputs only; otherwise an eager block's MLP node is the widest moment."""
    return impl.recompute in ("full", "op") or (impl.recompute == "every-k" and all(
        impl.checkpointed(i) for i in range(model.num_layers)))


def device_items(split: OffloadSplit) -> list[MemoryItem]:
    """Every saved activation of every block, flat: kept ones as they are, offloaded ones as
    zero-byte items noting where they went (the phases still see every block)."""
    host = {it.name for it in split.host}
    out = []
    for it in _all_items(split):
        if it.name in host and it.name not in split.reasons:
            it = MemoryItem(name=it.name, category=Category.ACTIVATION, shape=it.shape, dtype=it.dtype, bytes=0,
                            formula=it.formula, dims=it.dims, note=f"offloaded to host ({it.bytes} bytes)")
        out.append(it)
    return out


def _all_items(split: OffloadSplit):
    """Device and host items in one list, each name once (the caller's ids are in both)."""
    seen: set[str] = set()
    for it in (*split.device, *split.host):
        if it.name not in seen:
            seen.add(it.name)
            yield it


def working_bytes(split: OffloadSplit) -> dict[str, dict[str, int]]:
    """The offload's device buffers per phase of ``estimate.peak.phases``: the forward stash until
    the loss backward is done, the tensors brought back during the blocks' backward."""
    stash, back = {"offload_stash": split.stash_bytes}, {"offload_in_flight": split.in_flight_bytes}
    return {"forward": stash, "backward_start": stash, "backward": back, "backward_first_block": back}


def offloads_activations(parallel) -> bool:
    """``--offload activations`` on one device, nothing else parallel: the single-device estimate
    with this module's split (offload of optimizer states or parameters is per-rank)."""
    if parallel is None or "activations" not in parallel.offload:
        return False
    from dataclasses import replace
    return replace(parallel, offload=tuple(o for o in parallel.offload if o != "activations")).is_single


def apply_offload(model, step, impl, states: Inventory, acts: Inventory,
                  recompute: dict[int, tuple[int, int]], finetune=None):
    """``(inventory, recompute_bytes, working, host)`` for ``estimate.peak.phases`` under activation
    offload: the device inventory, each block's largest saved tensor kept for the gradient it
    still gets in backward, the stash and in-flight buffers, and what went to host."""
    from trainmem.estimate.peak import layer_stats

    split = activation_offload(model, step, impl, finetune=finetune)
    largest = layer_stats(acts).largest
    rec = {li: (recompute.get(li, (0, 0))[0], max(recompute.get(li, (0, 0))[1], big)) for li, big in largest.items()}
    return states + Inventory(device_items(split)), rec, working_bytes(split), split.host
