"""The peak is not a sum: model the step in phases and take the largest live set.

Phases of a steady-state step (optimizer state exists; gradients were zeroed with
``set_to_none``; only ``loss`` is kept from the outputs):

* ``forward``        -- end of forward, inside the loss: all saved activations, plus the logits
                        and their fp32 copy that the output object still holds.
* ``stack_end``      -- ``--profile traced``, an encoder-decoder: the decoder stack's last op, its
                        locals (T5's position biases, input embeddings, KV cache) beside every kept
                        tensor but the head's (``traced/record.py`` ``_held``).
* ``backward_start`` -- the loss backward: all activations, plus the gradient of the
                        log-softmax output and of the fp32 logits (two B·S·V·4 tensors).
* ``backward``       -- backward of the last block: head gradients exist, the last block's
                        recomputed activations (if checkpointed) and its gradient working set.
* ``backward_first_block`` -- backward of the first block, which runs last: every later
                        gradient exists beside its recomputed activations and working set (the
                        peak under full recompute when the optimizer step is not the peak).
* ``backward_end``   -- every gradient exists, activations are gone.
* ``optimizer``      -- every gradient plus the optimizer's temporaries.

With gradient accumulation, gradients exist from the second micro-batch on, so they are
counted in every phase (the peak does not grow with the number of micro-batches).

With the optimizer in backward (torchtune's ``optimizer_in_bwd``: each parameter steps in its
post-accumulate-grad hook, which then frees the gradient) no phase holds the gradients and the
``optimizer`` phase is replaced by ``step_in_backward``: the largest parameter's gradient and
step temporaries, taken at the head (its gradient arrives while every activation is alive; the
log-softmax gradient that produced it is alive until the step starts, the head's input gradient
throughout). An embedding-sized parameter stepped later, with fewer activations alive, costs less:
the phase is an upper bound there. A tied head is the exception (``tied_head``): the shared
weight has one post-accumulate-grad hook, which fires once, after autograd summed its two
gradients, the head's (first) and the embedding's (last). So its head gradient stays alive from
the head's backward to the end, ``backward_end`` holds the two and their sum, and the shared
weight steps last (its temporaries then); ``step_in_backward`` is the largest of the head's
matmul (no step there), the last block's largest parameter stepped next to the head gradient, and
that last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.estimate.block_backward import final_norm_moment, norm_backward_parts
from trainmem.estimate.compiled_ce_loss import compiled_ce_backward, graph_tangents
from trainmem.estimate.compiled_embedding_backward import embedding_backward_parts
from trainmem.estimate.grad_items import head_weight_grad
from trainmem.estimate.heads import is_classifier
from trainmem.estimate.compiled_recompute import compiled_checkpoint_moments
from trainmem.estimate.cp_ring_moments import before_the_head, ring_attention_moments, ring_forward_held
from trainmem.estimate.phase import Phase
from trainmem.estimate.losses import FRAMEWORK_LOSSES, framework_loss_phases, lora_head_input
from trainmem.names import is_embedding, is_embedding_indices, is_head, is_token_embedding, layer_of, stack_block

__all__ = ["Phase", "PhasedResult", "LayerStats", "phases", "layer_stats", "recompute_per_layer"]


class PhasedResult:
    """Shared by results that have an ``inventory`` and ``phases``: totals and the peak."""

    inventory: Inventory
    phases: tuple[Phase, ...]

    @property
    def totals_bytes(self) -> dict[str, int]:
        return self.inventory.totals()

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes


@dataclass
class LayerStats:
    """Per-category totals and per-block sums of an inventory (templates counted per block)."""

    by_cat: dict[Category, int] = field(default_factory=dict)
    act_layer: dict[int, int] = field(default_factory=dict)
    largest: dict[int, int] = field(default_factory=dict)
    largest_uncast: dict[int, int] = field(default_factory=dict)
    """The largest saved tensor per block but autocast's weight copies (:func:`_uncast_work`)."""
    grad_layer: dict[int, int] = field(default_factory=dict)
    head_act: int = 0
    loss_act: int = 0
    loss_value: int = 0
    """The loss the caller holds (``loss.value``, estimate/loss_value.py): made at the end of the loss."""
    nll_saved: int = 0
    """``nll_loss``'s saved target and total weight (``loss.target``, ``loss.total_weight``; traced: the
    int64 target by the op that made it, ``loss.nll_loss_forward``)."""
    aux_saved: int = 0
    """The load-balancing loss's kept set (``loss.load_balancing.*``, estimate/rules_hf_moe.py): released
    before the cross-entropy's backward, whose branch runs after it."""
    router_rows: dict[int, int] = field(default_factory=dict)
    """Block -> the elements of its router logits (those of its kept softmax, ``probs_layer{i}``), whose
    gradient from the load-balancing loss is alive from the loss's backward until that block's router
    backward, in the logits' dtype (compiled, the kept softmax is fp32)."""
    compiled_ce: bool = False
    largest_grad: int = 0
    late_grad: int = 0
    """Gradients produced after the blocks' backward: an untied input embedding's (a tied one gets
    its gradient from the head, first)."""
    has_head: bool = True
    """Whether the items hold a head's gradient (not a pipeline stage before the last)."""

    def add(self, it: MemoryItem, li: int | None, times: int = 1, *, graded: bool = True) -> None:
        """``graded``: autograd makes a gradient for the tensor (:func:`_no_gradient_copies`)."""
        self.by_cat[it.category] = self.by_cat.get(it.category, 0) + it.bytes * times
        if it.category is Category.ACTIVATION:
            if li is not None:
                self.act_layer[li] = self.act_layer.get(li, 0) + it.bytes
                self.largest[li] = max(self.largest.get(li, 0), it.bytes if graded else 0)
                if not it.name.endswith(_COPY):
                    self.largest_uncast[li] = max(self.largest_uncast.get(li, 0), it.bytes)
            elif is_head(it.name):
                self.head_act += it.bytes
                name = it.name.removeprefix("lm_head.")  # whole-model compile's loss (rules_compiled.py _head_and_loss)
                if name.startswith("loss."):
                    self.loss_act += it.bytes
                    if name == "loss.value":
                        self.loss_value += it.bytes
                    elif name in ("loss.total_weight", "loss.nll_loss_forward") or it.dtype == "int64":
                        self.nll_saved += it.bytes  # --profile traced: the target by its op, loss.clone
                    elif name == "loss.logsumexp":  # a compiled ForCausalLMLoss (estimate/compiled_ce_loss.py)
                        self.compiled_ce = True
                    elif name.startswith(AUX_LOSS):
                        self.aux_saved += it.bytes
                        layer = it.name.rpartition("probs_layer")[2]
                        if layer.isdigit():
                            self.router_rows[int(layer)] = it.bytes // dtype_bytes(it.dtype)
        elif it.category is Category.GRADIENT:
            self.largest_grad = max(self.largest_grad, it.bytes)
            if li is not None:
                self.grad_layer[li] = self.grad_layer.get(li, 0) + it.bytes


AUX_LOSS = "loss.load_balancing."  # estimate/rules_hf_moe.py load_balancing_items


def _stored_and_new(grads: int, stored: int) -> dict:
    """A node moment's gradients: at most every gradient item (``gradients``); beyond them, gradients that are
    not items (``new_gradients``): under accumulation the block's new ones beside their stored ``.grad``, under
    FSDP the unsharded ones before their reduce-scatter. The split keeps the sum; it names what is not an item."""
    return {"gradients": min(grads, stored), "new_gradients": grads - min(grads, stored)}


def _held_and_recomputed(held: int, recomputed: int, freed: int) -> dict:
    """A node moment's activations: what the step holds as items (``activations``) and a checkpointed block's
    recomputed set (``recomputed``, not items), less what the block's nodes freed by then, taken from the
    recomputed set first (its own saved tensors are what its backward frees)."""
    rec_left = max(0, recomputed - freed)
    return {"activations": held - (freed - (recomputed - rec_left)), "recomputed": rec_left}


def node_moments_off(working: dict, node_moments: bool) -> bool:
    """Whether the block working set alone stands (a distributed working set, without node moments)."""
    return bool(working.get("backward")) and not node_moments


def _block_reader(stacks: tuple[tuple[str, int], ...] = ()):
    """How an item's block is read: by the shared names (:func:`layer_of`), or, given two stacks of
    blocks (an encoder-decoder's ``--profile traced`` ``Template.stacks``: each stack's blocks' prefix
    and depth), counted through both in forward order (:func:`trainmem.names.stack_block`): encoder
    blocks first, decoder blocks after."""
    if len(stacks) < 2:
        return layer_of
    return lambda name: stack_block(name, stacks)


def layer_stats(items: "Inventory | list[MemoryItem]", stacks: tuple[tuple[str, int], ...] = ()) -> LayerStats:
    """Per-block sums of ``items``; ``stacks``: see :func:`_block_reader`."""
    st = LayerStats()
    if not isinstance(items, Inventory):
        items = Inventory(items)
    block_of = _block_reader(stacks)
    outside: list[MemoryItem] = []
    ungraded = _no_gradient_copies(items.base)
    for it in items.base:
        li = block_of(it.name)
        st.add(it, li, graded=it.name not in ungraded)
        if li is None and it.category is Category.GRADIENT:
            outside.append(it)
    # untied head, a classification head (estimate/heads.py), or no head (a pipeline stage before the last): the
    # embedding's gradient comes last
    st.has_head = any(is_head(it.name) for it in outside)
    if any(it.name.startswith("lm_head.") or is_classifier(it.name) for it in outside) or not st.has_head:
        st.late_grad = sum(it.bytes for it in outside if not is_head(it.name))
    else:  # tied: the token embedding's is the head's; other embeddings' (GPT-2's positions) come last
        st.late_grad = sum(it.bytes for it in outside if is_embedding(it.name) and not is_token_embedding(it.name))
    for r in items.repeats:
        # one pass over the template, then its per-block sums land on every repeated block
        per_shift: dict[int, list[int]] = {}  # shift -> [activation bytes, largest, gradient bytes, largest uncast]
        own = r.src if block_of is layer_of else block_of(f"{r.prefix}{r.src}.x")  # src's number in the count
        for it in r.items:
            st.by_cat[it.category] = st.by_cat.get(it.category, 0) + it.bytes * len(r.dsts)
            if it.category is Category.GRADIENT:
                st.largest_grad = max(st.largest_grad, it.bytes)
            li = block_of(it.name)
            if li is None:
                continue
            acc = per_shift.setdefault(0 if li == own else -1, [0, 0, 0, 0])  # -1: previous block's
            if it.category is Category.ACTIVATION:
                acc[0] += it.bytes
                acc[1] = max(acc[1], it.bytes)
                acc[3] = max(acc[3], 0 if it.name.endswith(_COPY) else it.bytes)
            elif it.category is Category.GRADIENT:
                acc[2] += it.bytes
        for d in r.dsts:
            for shift, (act, big, grad, uncast) in per_shift.items():
                li = own - r.src + d + shift
                if act:
                    st.act_layer[li] = st.act_layer.get(li, 0) + act
                    st.largest[li] = max(st.largest.get(li, 0), big)
                    st.largest_uncast[li] = max(st.largest_uncast.get(li, 0), uncast)
                if grad:
                    st.grad_layer[li] = st.grad_layer.get(li, 0) + grad
    return st


def phases(items: "Inventory | list[MemoryItem]", *, B: int, S: int, vocab: int, logits_dtype: str,
           loss_dtype: str, loss: str, grad_accum: int, recompute_bytes: dict[int, tuple[int, int]],
           optimizer_transient: tuple[int, str], residual_bytes: int,
           persistent: dict[str, int] | None = None,
           working: dict[str, int] | dict[str, dict[str, int]] | None = None,
           optimizer_in_backward: bool = False, compiled_loss: bool = False, stack_held: int = 0,
           stacks: tuple[tuple[str, int], ...] = (), tied_head: bool = False,
           node_moments: bool = False, accumulate_transients: bool = False,
           recomputed: Inventory | None = None, block_math: dict | None = None,
           grad_received: bool = False, logits_held: bool = False,
           middle_blocks: dict[int, tuple[int, dict[str, int]]] | None = None,
           head_graph_apart: bool = False, fsdp_pp_grads: int = 0, ring=None,
           attention_recompute: bool = False) -> list[Phase]:
    """The live bytes of each phase. ``loss='none'``: this rank computes no loss (a pipeline
    stage before the last). ``persistent`` buffers live through the whole step (DDP buckets);
    ``working`` ones during forward and backward (FSDP all-gathers, ring buffers), either one dict
    for every such phase or a dict per phase name. ``optimizer_in_backward``: the optimizer
    steps each parameter inside backward and ``optimizer_transient`` is one parameter's.
    ``compiled_loss``: torchtune's chunk function runs compiled (estimate/compiled_chunk_loss.py).
    ``stack_held``: an encoder-decoder's last stack's locals at its end, besides the kept tensors
    (``--profile traced``, ``traced/record.py`` ``_held``): the ``stack_end`` phase. ``stacks``: its
    template's stacks of blocks (``Template.stacks``), blocks counted through both (:func:`layer_stats`).
    ``tied_head``: the output layer is the input embedding's weight (see the module docstring).
    ``node_moments``: model a block's node moments beside the ``working`` buffers too (they are the
    same through the block's backward: FSDP2's, estimate/fsdp_timeline.py).
    ``accumulate_transients``: with ``grad_accum`` > 1, each new gradient beside the stored ``.grad``
    it is added into (estimate/grad_accum.py; one device). ``recomputed``: the inventory without
    checkpointing under ``--recompute full``: a checkpointed block's node moments run on its recomputed
    tensors (estimate/block_backward.py). ``block_math``: the block's MLP activation and norm kind
    (``activation``, ``unit_offset_norm``) its compiled checkpoint moments read (estimate/compiled_recompute.py).
    ``grad_received``: the last block's output gradient is a receive buffer counted in ``working`` (a pipeline
    stage before the last: ``pp_recv_gradients``), not a new residual gradient in its eager moments before the
    residual sum. ``logits_held``: the logits outlive the loss (a pipeline's output chunks), so the compiled
    loss's backward does not free them. ``middle_blocks``: FSDP2 (estimate/fsdp_timeline.py ``middle_blocks``), blocks
    between the first and the last whose backward moment is taken too, each with its gradient correction (the later
    blocks hold sharded gradients, not autograd's) and the buffers alive there instead of ``working``'s: the
    ``backward`` phase is the largest of these and the last block's. ``head_graph_apart``: whole-model compile runs
    the head in a graph of its own (estimate/compiled_embedding_backward.py). ``fsdp_pp_grads``: FSDP2's shard group
    per pipeline stage (estimate/parallel_pp.py ``fsdp_stage_moments``): a node moment's gradients are the block's new
    ones, unsharded, beside the unsharded buffer ``working`` holds (no earlier gradient of its own). ``ring``:
    context parallelism's ring buffers per rank class (estimate/context_parallel.py ``RingBuffers``), moments of
    each block's attention backward and of the last block's attention forward (estimate/cp_ring_moments.py)."""
    persistent = {k: v for k, v in (persistent or {}).items() if v}
    working = working or {}
    if working and not isinstance(next(iter(working.values())), dict):  # one dict for every phase
        working = {p: dict(working) for p in ("forward", "backward_start", "backward", "backward_end")}
    st = layer_stats(items, stacks)
    # the load-balancing loss's router-logit gradients, in the logits' dtype (the LM head's: a pure precision)
    router_grads = {li: n * dtype_bytes(logits_dtype) for li, n in st.router_rows.items()}
    by_cat, act_layer, largest, grad_layer, head_act = st.by_cat, st.act_layer, st.largest, st.grad_layer, st.head_act
    P = by_cat.get(Category.PARAMETER, 0)
    G = by_cat.get(Category.GRADIENT, 0)
    stored_G = 0 if optimizer_in_backward else G  # gradients that outlive their hook
    # a tied weight's head gradient waits in backward for the embedding's: autograd sums the two
    # before the weight's one AccumulateGrad node (and its hook) runs
    tied_sum = _head_weight_grad(items) if tied_head and loss != "none" else 0
    tied_G = tied_sum if optimizer_in_backward else 0  # ... and, in backward, steps and frees it
    M = by_cat.get(Category.MASTER_WEIGHT, 0)
    O = by_cat.get(Category.OPTIMIZER_STATE, 0)
    A = by_cat.get(Category.ACTIVATION, 0)
    # the model's registered buffers (estimate/buffers.py) are resident all step, like the parameters
    static = {"parameters": P, "master_weights": M, "optimizer_states": O, "buffers": by_cat.get(Category.BUFFER, 0)}
    g_acc = G if grad_accum > 1 else 0
    grads_head = G - sum(grad_layer.values()) if grad_layer else G
    # the non-layer gradients produced before the blocks' backward are the head's; the
    # embedding's arrive last. Approximate "head" as everything outside blocks except the
    # embedding, which a tied head produces early anyway.
    BSV = B * S * vocab
    out: list[Phase] = []
    ids = _caller_ids(items)

    def add(name: str, parts: dict[str, int], note: str, own: dict[str, int] | None = None) -> None:
        bufs = {**persistent, **{k: v for k, v in (working.get(name, {}) if own is None else own).items() if v}}
        if ids and name != "optimizer":  # the caller's token ids (_caller_ids), where activations are counted
            bufs["caller_ids"] = ids
        full = {**static, **{k: v for k, v in parts.items() if v}, **bufs}
        out.append(Phase(name, sum(full.values()), full, note))

    if loss == "ce":
        lb = dtype_bytes(loss_dtype)
        logits = int(BSV * dtype_bytes(logits_dtype))
        upcast = int(BSV * lb) if loss_dtype != logits_dtype else 0
        # inside the cross-entropy the load-balancing loss (after it) is not made yet; the output holds every MoE
        # block's router logits for it (transformers' OutputRecorder), the bytes of its kept softmax each
        add("forward", {"gradients": g_acc, "activations": A - st.aux_saved, "logits": logits + upcast,
                        "router_logits": sum(router_grads.values())},
            "end of forward: saved activations + logits (and their upcast copy) held by the output")
        # log_softmax's backward runs after NllLossBackward0 released its saved target and total weight
        # (torch/csrc/autograd/engine.cpp, Node::release_variables after call_function); the seed
        # gradient of the loss (torch/autograd/__init__.py _make_grads: ones_like) is alive
        # compiled, the recomputed fp32 log-softmax's first step, its logits input freed (estimate/compiled_ce_loss.py)
        held = 0 if logits_held else logits
        ce = (held, compiled_ce_backward(BSV, held, B * S)) if st.compiled_ce else (0, int(2 * BSV * lb))
        add("backward_start", {"gradients": g_acc, "activations": A - st.nll_saved - st.aux_saved - ce[0],
                               "logits_grad": ce[1], "loss_seed": lb if st.nll_saved else 0,
                               # one graph: its outputs' zero-filled tangents (estimate/compiled_ce_loss.py)
                               "zero_tangents": graph_tangents(items, logits) if st.compiled_ce and (
                                   block_math or {}).get("one_graph") else 0,
                               "router_logits_grad": sum(router_grads.values())},
            f"loss backward: activations + grad of the log-softmax output and of the logits (2·B·S·V·{lb:g})")
    elif loss in FRAMEWORK_LOSSES:  # torchtune's / LitGPT's chunked CE (estimate/losses.py)
        from trainmem.estimate.compiled_chunk_loss import compiled_chunk_phases
        fl = (compiled_chunk_phases if compiled_loss else framework_loss_phases)(
            loss, B=B, S=S, V=vocab, logits_dtype=logits_dtype, hidden_row_bytes=residual_bytes // (B * S),
            head_weight_grad=_head_weight_grad(items),
            lora_head_input=lora_head_input(items, B, S, residual_bytes // (B * S)))
        if fl.held:  # LitGPT's loop keeps its logits bound in every phase
            persistent["logits_held"] = fl.held
        # inside the last chunk the loss value (total / count) is not made yet
        fwd = {"gradients": g_acc, "activations": A - st.loss_value, **fl.forward}
        head = {"gradients": g_acc, "activations": A - st.loss_act, **(fl.head_forward or {})}
        if fl.head_forward and sum(head.values()) > sum(fwd.values()):
            add("forward", head, "inside the last LoRA head chunk: its frozen and adapter outputs and their sum, "
                                 "the earlier chunks' logits, the loop's previous logits (estimate/losses.py)")
        else:
            add("forward", fwd, f"end of forward, inside the last chunk of {loss}: saved activations + the chunks' logits")
        add("backward_start", {"gradients": g_acc, "activations": A, **fl.backward_start},
            f"{loss} backward, chunk by chunk: one chunk's log-softmax gradients + the logit gradients so far")
        if fl.head_backward:
            add("head_backward", {"gradients": g_acc, "activations": A - st.loss_act, **fl.head_backward},
                "the head's chunk matmuls backward: two chunks' weight gradients and their sum, the logit "
                "gradients still to run")
    else:
        add("forward", {"gradients": g_acc, "activations": A},
            "end of forward" + (" (chunked loss)" if loss != "none" else ""))
    if stack_held:  # before the head: T5Stack.forward's position biases, embeddings and cache, its last outputs
        add("stack_end", {"gradients": g_acc, "activations": A - head_act, "stack_locals": stack_held},
            "end of the decoder stack: every kept tensor but the head's, and the stack's locals "
            "(position biases, input embeddings, KV cache, the final norm's and dropout's outputs)")
    # a checkpointed block may keep nothing under its own name (--profile traced names the held
    # input by the op that made it, in the block before): it still runs a backward, recomputing
    blocks = set(act_layer) | set(recompute_bytes)
    last = max(blocks) if blocks else None
    if last is not None and (fwd := ring_forward_held(items, last, A - head_act - act_layer.get(last, 0), ring,
                                                      recomputed)):
        at = next(k for k, p in enumerate(out) if p.name == "forward")  # CP's ring inside the last attention
        add("forward", {"gradients": g_acc, **fwd}, "the last block's ring attention forward: the activations "
            "kept so far, the block's attention inputs and the ring's buffers (estimate/cp_ring_moments.py)",
            own=before_the_head(working.get("forward", {})))  # the loss's extras do not exist yet
        out[at] = max(out[at], out.pop(), key=lambda p: p.bytes)
    if last is not None:
        # the gradient of the block output, plus the gradient of the largest saved tensor
        # while that tensor is still held (e.g. dP next to P in eager attention)
        rec, rec_big = recompute_bytes.get(last, (0, 0))
        big = max(largest.get(last, 0), rec_big)
        work = rec + residual_bytes + big
        # beside a head the late gradient does not exist yet (cf2822d, measured on one device); a stage before the
        # last (no head) keeps it counted, as before cf2822d: without it the compiled GPipe stage 0 read 0.981 of the
        # fake-PG trace (tests/estimate/test_compiled_3d.py), a moment not explained yet
        late = st.late_grad if st.has_head else 0
        g_now = G if grad_accum > 1 else grads_head - late if not optimizer_in_backward else tied_G
        parts = {"gradients": g_now, "activations": A - head_act, "recompute_and_work": work,
                 "router_logits_grad": sum(router_grads.values())}  # every block's router backward is to come
        note = ("backward of the last block: head gradients, remaining activations, recomputed "
                "block activations, the output gradient and the gradient of its largest tensor")

        def inside(li: int, grads_before: int, acts_before: int, parts: dict, note: str) -> tuple[dict, str]:
            """The larger of a block's working set and its nodes' moments (estimate/block_backward.py):
            its MLP product's and RMSNorms' backward, with the block's gradients made by then."""
            if (li in recompute_bytes and recomputed is None and not attention_recompute) or optimizer_in_backward or \
                    node_moments_off(working, node_moments):
                return parts, note
            # a checkpointed block recomputed its forward first: its tensors are alive beside the rest; they are not
            # inventory items (a checkpoint keeps only the block's input), so they get their own part, "recomputed"
            rec_add = recompute_bytes.get(li, (0, 0))[0] if recomputed is not None else 0
            rec_li = recomputed if li in recompute_bytes else None
            # a checkpointed compiled block's MLP moments (estimate/compiled_recompute.py; none for eager sets)
            # a fine-tuned compiled block (block_math eager_set) runs no eager nodes: compiled_finetune_moment.py's
            eager_nb = [] if (block_math or {}).get("eager_set") else norm_backward_parts(items, li, residual_bytes, rec_li)
            eager_nb += ring_attention_moments(items, li, residual_bytes, ring, rec_li)
            compiled_nb = compiled_checkpoint_moments(items, li, residual_bytes, rec_li, **(block_math or {}))
            if eager_nb and (li not in recompute_bytes or attention_recompute) and "recompute_and_work" in parts:
                parts = _uncast_work(parts, st.largest.get(li, 0), st.largest_uncast.get(li, 0))
            if compiled_nb and rec_li is not None:  # they model the block's backward (compiled_op_moment.py: a deferred
                parts = {k: v for k, v in parts.items() if k != "recompute_and_work"}  # recompute holds less)
            for nb in (*eager_nb, *compiled_nb):
                # the first block's attention backward frees what the blocks share (rotary cos/sin:
                # their saved-by-rope references are gone); the embedding keeps its indices
                shared = _shared_block_inputs(items) if nb["after_attention"] and li == min(blocks) else 0
                # node_work: the residual gradient, the node's temporaries, and the loss and its seed
                # gradient (ones_like), alive through backward
                # FSDP2 per pipeline stage (estimate/parallel_pp.py fsdp_stage_moments): every earlier gradient is in
                # the unsharded buffer ``working`` counts; the block's new ones are unsharded, not yet accumulated
                at = {**({"gradients": nb["block_gradients"] * fsdp_pp_grads} if fsdp_pp_grads else _stored_and_new(
                          grads_before + nb.get("new_gradients", nb.get("accum_new_gradients", 0) if grad_accum > 1
                                                else nb["block_gradients"]), G)),
                      **_held_and_recomputed(acts_before, rec_add, nb["freed_activations"] + shared),
                      "node_work": nb["work"] + (2 * dtype_bytes(loss_dtype) if loss == "ce" else 0)
                      - (residual_bytes if grad_received and li == last and not nb["after_attention"]
                         and any(nb is e for e in eager_nb) else 0),
                      "router_logits_grad": parts.get("router_logits_grad", 0)}
                if sum(at.values()) > sum(parts.values()):
                    parts, note = at, (f"{note.split(':')[0].split(', at its')[0]}, at its MLP product's or an RMSNorm's backward: "
                                       "gradients so far, the residual gradient and the node's temporaries")
            return parts, note

        parts, note = inside(last, G if grad_accum > 1 else grads_head - st.late_grad, A - head_act, parts, note)
        fn = final_norm_moment(items, head_act=head_act, loss_scalars=2 * dtype_bytes(loss_dtype) if loss == "ce" else 0)
        if fn and not optimizer_in_backward and not node_moments_off(working, node_moments):
            at = {"gradients": G if grad_accum > 1 else grads_head - st.late_grad, "activations": A - head_act + fn[0],
                  "node_work": fn[1], "router_logits_grad": parts.get("router_logits_grad", 0)}
            if sum(at.values()) > sum(parts.values()):
                parts, note = at, ("the final RMSNorm's backward: the head's gradients, the blocks' activations "
                                   "and the norm's five fp32 temporaries (estimate/block_backward.py)")
        add("backward", parts, note)
        for li, (g_fix, own) in sorted({**_mixed_middle(blocks, recompute_bytes), **(middle_blocks or {})}.items()):
            # a middle block holds what neither end does (FSDP2: the next block's prefetch beside the previous
            # one's reduce-scatter input), so the ends do not bound it: its moment, as the first block's below
            rec_i, big_i = recompute_bytes.get(li, (0, 0))
            g_i = G - sum(v for j, v in grad_layer.items() if j <= li) - st.late_grad + g_fix
            acts_i = A - head_act - sum(v for j, v in act_layer.items() if j > li)
            add("backward", *inside(li, g_i, acts_i, {
                "gradients": g_i, "activations": acts_i, "recompute_and_work": rec_i + residual_bytes + max(
                    largest.get(li, 0), big_i), "router_logits_grad": sum(v for j, v in router_grads.items() if j <= li)},
                f"backward of block {li}: the later blocks' gradients, its recomputed block activations, the output "
                "gradient and the gradient of its largest tensor"), own=own)
            out[-2:] = [max(out[-2:], key=lambda p: p.bytes)]  # one backward phase: the largest block moment
        first = min(blocks)
        if first != last and not optimizer_in_backward:
            # the first block's backward runs last: every later block's gradients exist next to its
            # recomputed activations and working set. Live bytes are linear in the block index between
            # the two ends (gradients accumulate, activations drain), so the ends bound every block.
            rec0, rec_big0 = recompute_bytes.get(first, (0, 0))
            work0 = rec0 + residual_bytes + max(largest.get(first, 0), rec_big0)
            g_first = G if grad_accum > 1 else G - grad_layer.get(first, 0) - st.late_grad
            acts0 = A - head_act - sum(act_layer.values()) + act_layer.get(first, 0)
            add("backward_first_block", *inside(
                first, g_first, acts0, {"gradients": g_first, "activations": acts0, "recompute_and_work": work0,
                                        "router_logits_grad": router_grads.get(first, 0)},
                "backward of the first block, the last to run: every later gradient exists, its "
                "recomputed block activations, the output gradient and the gradient of its largest tensor"))
    # the embedding's backward runs last: the blocks' shared inputs (rotary cos/sin) and the embedding
    # output block 0 kept (its norm's input in fp32) were freed by the first block's nodes; the
    # embedding keeps its indices
    end_freed = _shared_block_inputs(items) + _embedding_outputs(items) if blocks else 0
    acts_end = A - head_act - sum(act_layer.values()) - end_freed
    loss_scalars = 2 * dtype_bytes(loss_dtype) if loss == "ce" else 0  # the loss and its seed gradient
    end_note = ("all gradients exist, block activations freed" if not optimizer_in_backward
                else "gradients were stepped and freed in backward, block activations freed")
    g_end, work_end = stored_G, residual_bytes
    # the gradients alive beside this micro-batch's tied-weight gradients: the sum becomes the
    # weight's .grad (AccumulateGrad steals it; counted in stored_G) unless a .grad from an earlier
    # micro-batch exists; in backward the hook steps it and no gradient is stored
    before = stored_G - (tied_sum if stored_G and grad_accum == 1 else 0)
    if tied_sum:  # the token embedding's backward runs last: the others (positions) freed their ids
        acts_end -= _later_embedding_indices(items)
    if tied_sum and tied_sum >= residual_bytes:
        # torch/csrc/autograd/input_buffer.cpp (accumulate): the head's gradient (a transposed mm
        # result) and the embedding's are summed out of place, after the embedding node released
        # its output gradient; the sum is what AccumulateGrad (and its hook) gets
        g_end, work_end = before + 3 * tied_sum, 0
        end_note += "; the tied weight's head and embedding gradients and their sum"
    elif tied_sum:
        g_end = before + 2 * tied_sum
        end_note += "; the tied weight's head and embedding gradients"
    end = {"gradients": g_end, "activations": acts_end, "work": work_end, "loss_scalars": loss_scalars}
    if (block_math or {}).get("one_graph"):  # the whole model compiled: estimate/compiled_embedding_backward.py
        emb = embedding_backward_parts(items.base if isinstance(items, Inventory) else items, B=B, S=S,
                                       stored_grads=stored_G, grad_accum=grad_accum, tied=bool(tied_sum),
                                       activations=acts_end, loss_scalars=loss_scalars,
                                       head_grad=_head_weight_grad(items),
                                       head_graph_apart=head_graph_apart)
        if emb and sum(emb.values()) > sum(end.values()):
            end, end_note = emb, ("the compiled embedding backward's index-put, the last node: two (V, H) tables in "
                                  "the computation dtype beside the other gradients (embedding_dense_backward)")
    add("backward_end", end, end_note)
    tb, rule = optimizer_transient
    if not optimizer_in_backward:
        add("optimizer", {"gradients": G, "optimizer_temporaries": tb}, f"optimizer.step(): {rule}")
        if accumulate_transients:  # estimate/grad_accum.py: the new gradients of a later micro-batch
            from trainmem.estimate.grad_accum import with_accumulation
            out = with_accumulation(
                out, items, grad_accum=grad_accum, loss=loss, loss_dtype=loss_dtype,
                logits_grad=int(BSV * dtype_bytes(logits_dtype)), residual_bytes=residual_bytes,
                head_grad=_head_weight_grad(items), tied=tied_head and loss != "none", gradients=G,
                head_acts=A - st.loss_act, block_acts=A - head_act, static=static,
                bufs={**persistent, **{k: v for k, v in working.get("backward_start", {}).items() if v}})
        return out
    # the head's weight gradient exists next to the logits' gradient that produced it, in the logits'
    # dtype (bf16 + ce: ToCopyBackward0 casts the fp32 log-softmax gradient back, and the engine frees
    # that before MmBackward runs; real CPU steps: tests/estimate/test_untied_in_backward.py, tied:
    # test_tied_in_backward.py); by its hook that gradient and the head's saved input (residual-sized)
    # are freed, the loss's are too, but for the loss and its seed gradient
    logits_grad = int(BSV * dtype_bytes(logits_dtype)) if loss == "ce" else 0
    if tied_G:
        add("step_in_backward", *_tied_steps(
            head={"activations": A - st.loss_act, "loss_scalars": loss_scalars, "work": residual_bytes,
                  "gradients": tied_G, "logits_grad": logits_grad},
            block=_block_step(_largest_block_grad(items), st.largest_grad, tb, A - head_act, residual_bytes, tied_G),
            last={"activations": acts_end, "loss_scalars": loss_scalars, "gradients": tied_G,
                  "optimizer_temporaries": tb}, rule=rule))
        return out
    at_mm = logits_grad >= tb - residual_bytes
    held = {"logits_grad": logits_grad} if at_mm else {"optimizer_temporaries": tb}
    acts = A - st.loss_act - (0 if at_mm else residual_bytes)
    add("step_in_backward", {"activations": acts, "work": residual_bytes, "gradients": st.largest_grad,
                             "loss_scalars": loss_scalars, **held},
        f"largest parameter stepped in its gradient hook while activations are alive: {rule}; "
        "the larger of its temporaries and the log-softmax gradient that produced it")
    return out


def _mixed_middle(blocks: set[int], recompute_bytes: dict) -> dict[int, tuple[int, None]]:
    """Under ``--recompute every-k`` (some blocks checkpointed, not all) live bytes are not linear in the block
    index: a checkpointed block's recomputation sits on the eager blocks' saved sets before it, so the ends bound
    nothing and every block between them takes its moment (no gradient correction, the phase's buffers).
    torchtitan's count checkpoints blocks k-1, 2k-1... (ImplSpec.checkpointed): at L=3, k=2 block 1's MLP backward
    is the step's top, the trace's 4,433,224 B, which the ends' moments read 90,112 B under (tiny Llama fp32 B2 S96)."""
    if not recompute_bytes or set(recompute_bytes) >= blocks:
        return {}
    return {li: (0, None) for li in sorted(blocks) if min(blocks) < li < max(blocks)}


def _largest_block_grad(items) -> int:
    """The largest gradient inside the blocks (templates included)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    grads = [i for i in (*inv.base, *(i for r in inv.repeats for i in r.items)) if i.category is Category.GRADIENT]
    return max((i.bytes for i in grads if layer_of(i.name) is not None), default=0)


def _block_step(big: int, largest: int, tb: int, acts: int, residual_bytes: int, tied_grad: int) -> dict[str, int]:
    """The last block's largest parameter (``big`` gradient bytes) stepped next to the tied head
    gradient: ``tb`` is the largest parameter's temporaries (``largest`` bytes), scaled to the
    block's (every one-tensor rule in estimate/optimizer_step.py is a multiple of its bytes)."""
    return {"activations": acts, "work": residual_bytes, "gradients": tied_grad + big,
            "optimizer_temporaries": tb * big // largest if largest else 0}


def _tied_steps(*, head: dict[str, int], block: dict[str, int], last: dict[str, int], rule: str
                ) -> tuple[dict[str, int], str]:
    """The largest of the three moments a tied head's step-in-backward has (the module docstring)."""
    notes = {"head": "the tied head's matmul backward: its weight gradient (stepped last, when the "
                     "embedding's arrives) next to the log-softmax gradient that produced it",
             "block": f"the last block's largest parameter stepped next to the tied head gradient: {rule}",
             "last": f"the tied weight stepped last, in its one hook: {rule}"}
    name, parts = max((("head", head), ("block", block), ("last", last)), key=lambda kv: sum(kv[1].values()))
    return parts, notes[name]


def _shared_block_inputs(items) -> int:
    """Saved tensors outside the blocks that only the blocks read (rotary cos/sin): neither the
    embedding's nor the head's."""
    base = items.base if isinstance(items, Inventory) else items
    return sum(i.bytes for i in base if i.category is Category.ACTIVATION and layer_of(i.name) is None
               and not is_head(i.name) and not is_embedding(i.name) and not is_embedding_indices(i.name))


def _embedding_outputs(items) -> int:
    """What an embedding's scope keeps besides its indices: its output, kept by the first block
    (``model.embed_tokens.out``; Gemma's scaled output and its scale), freed before the embedding's
    own backward runs. Every profile names them so (:func:`trainmem.names.embedding_output`)."""
    base = items.base if isinstance(items, Inventory) else items
    return sum(i.bytes for i in base if i.category is Category.ACTIVATION and layer_of(i.name) is None
               and is_embedding(i.name) and not is_embedding_indices(i.name))


def _caller_ids(items) -> int:
    """The caller's token ids (B, S) int64 that a frozen token embedding does not save: the caller holds its
    batch all step (``trace/step.py`` ``one_step``: ``inputs``; ``measure/workload.py``: ``Workload.ids``),
    and a trainable embedding saves that very tensor (its ``indices``, counted as an activation), a frozen one
    nothing (``estimate/finetune.py`` ``embedding_notes``: a zero-byte item with the ids' shape). Counted in the
    phases that count activations; the optimizer phase leaves the ids out either way (their gap there, B·S·8,
    is what the trace tests add: ``tests/estimate/test_optimizer_impl.py``)."""
    base = items.base if isinstance(items, Inventory) else items
    return sum(math.prod(i.shape) * 8 for i in base if i.category is Category.ACTIVATION and i.bytes == 0
               and is_token_embedding(i.name) and is_embedding_indices(i.name))


def _later_embedding_indices(items) -> int:
    """The ids kept by embeddings other than the token embedding (GPT-2's learned positions): they
    run after it in forward, so their backward nodes run (and free them) before its own."""
    base = items.base if isinstance(items, Inventory) else items
    return sum(i.bytes for i in base if i.category is Category.ACTIVATION and is_embedding_indices(i.name)
               and not is_token_embedding(i.name))


def _head_weight_grad(items) -> int:
    """The output layer's weight gradient bytes (estimate/grad_items.py), 0 when that weight is frozen."""
    g = head_weight_grad(items)
    return g.bytes if g else 0


def _uncast_work(parts: dict[str, int], largest: int, uncast: int) -> dict[str, int]:
    """The block working set where the block's node moments are read. A linear's autocast weight copy gets its
    gradient from the linear's own node (``MmBackward0``: ``grad.T @ x``, the copy's size), which runs after the
    block output's reader and every later node released their saved tensors (torch/csrc/autograd/engine.cpp,
    ``Node::release_variables``), so that gradient is never beside every block tensor; the MLP's and the first
    input projection's copies have their node and ``ToCopyBackward0`` moments read (block_backward.py
    ``_cast_weight_moment``). The working set holds the gradient of the largest other saved tensor. Tiny Llama /
    Qwen2 h64 F176 amp-bf16 B1 S32: the MLP's 22,528 B copies were taken, 10,096 / 9,584 B over the trace (whose
    top is the loss's forward). Not modelled: the attention's other projections' cast moments (their copies are
    left to the working set's other tensors; the sweeps in tests/estimate/test_peak_gaps.py show no case under)."""
    return {**parts, "recompute_and_work": parts["recompute_and_work"] - largest + uncast}


_COPY = ".weight_cast"  # the HF rules' autocast weight copy (estimate/ctx.py ``plain_linear``)


def _no_gradient_copies(base: list[MemoryItem]) -> set[str]:
    """Autocast's copies of frozen weights (``<linear>.weight_cast`` beside fine-tuning's marker that the
    linear's weight is frozen, ``<linear>.input``: estimate/finetune.py ``_note``): ``mm`` saves the copy for
    its input's gradient, but the copy requires no gradient, so the block's working set holds none of its size
    (GPT-NeoX LoRA amp-bf16 B1 S64, full recompute: the frozen MLP's 131,072 B copies were taken for the largest
    gradient, 32,504 B over the trace)."""
    frozen = {i.name.removesuffix(".input") for i in base if i.category is Category.ACTIVATION and not i.bytes
              and i.name.endswith(".input") and i.note.startswith(_FROZEN_MARK)}
    return {i.name for i in base if i.name.endswith(".weight_cast") and i.name.removesuffix(".weight_cast") in frozen}


_FROZEN_MARK = "not saved: frozen weight"  # estimate/finetune.py ``_note``'s text for a frozen linear's input


def recompute_per_layer(kept, plain, stacks: tuple[tuple[str, int], ...] = ()) -> dict[int, tuple[int, int]]:
    """(bytes, largest tensor) each checkpointed block re-materializes in its backward: what the
    block would keep without checkpointing and does not keep with it. Op-level checkpointing keeps
    op outputs that plain autograd would not (a policy saves them whether or not backward reads
    them); those stay beside the recomputed ones, so they are not taken off. ``stacks``: see :func:`layer_stats`."""
    k, p = layer_stats(kept, stacks), layer_stats(plain, stacks)
    extra = layer_stats(_only_in(kept, plain), stacks).act_layer  # kept, but not what plain autograd keeps
    rec = {li: p.act_layer[li] - k.act_layer.get(li, 0) + extra.get(li, 0) for li in p.act_layer}
    return {li: (b, p.largest[li]) for li, b in rec.items() if b > 0}


def _only_in(kept: "Inventory | list[MemoryItem]", plain: "Inventory | list[MemoryItem]") -> Inventory:
    """``kept``'s activations whose names ``plain`` lacks (block templates compared as templates)."""
    kept = kept if isinstance(kept, Inventory) else Inventory(kept)  # the per-rank path passes lists
    plain = plain if isinstance(plain, Inventory) else Inventory(plain)
    names = {i.name for i in plain.base} | _block_names(plain)
    new = [i for i in kept.base if i.category is Category.ACTIVATION and i.name not in names]
    reps = [replace(r, items=tuple(i for i in r.items if i.category is Category.ACTIVATION and i.name not in names))
            for r in kept.repeats]
    return Inventory(new, reps)


def _block_names(inv: Inventory) -> set[str]:
    """Every block's item names, each repeat's template named for each of its blocks: under
    ``--recompute every-k`` the kept and the plain inventories group blocks into other repeats
    (``model.layers.1.x`` is a template of its own when block 1 is not checkpointed, a copy of
    ``model.layers.0.x`` without recompute)."""
    out: set[str] = set()
    for r in inv.repeats:
        own, prev = f"{r.prefix}{r.src}.", f"{r.prefix}{r.src - 1}."
        for i in r.items:
            for d in r.dsts:
                if i.name.startswith(own):
                    out.add(f"{r.prefix}{d}." + i.name[len(own):])
                elif r.shift_previous and i.name.startswith(prev):
                    out.add(f"{r.prefix}{d - 1}." + i.name[len(prev):])
                else:
                    out.add(i.name)
    return out
