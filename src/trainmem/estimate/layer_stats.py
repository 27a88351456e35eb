"""Per-block sums of an inventory: each block's saved activations, its largest saved tensor, its gradients,
and the head's and the loss's parts (:class:`LayerStats`, :func:`layer_stats`), which the phases
(estimate/peak.py) read; and what a checkpointed block recomputes in its backward
(:func:`recompute_per_layer`). Block templates (``Inventory.repeats``) are counted per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainmem.estimate.heads import is_classifier
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import is_head, is_token_embedding, layer_of, stack_block

__all__ = ["AUX_LOSS", "LayerStats", "layer_stats", "recompute_per_layer"]


@dataclass
class LayerStats:
    """Per-category totals and per-block sums of an inventory (templates counted per block)."""

    by_cat: dict[Category, int] = field(default_factory=dict)
    act_layer: dict[int, int] = field(default_factory=dict)
    largest: dict[int, int] = field(default_factory=dict)
    largest_uncast: dict[int, int] = field(default_factory=dict)
    """The largest saved tensor per block but autocast's weight copies (estimate/backward_moments.py ``_uncast_work``)."""
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
    else:  # tied: the token embedding's is the head's; other embeddings' (GPT-2's positions) and what runs before
        # the blocks (BERT's embeddings.LayerNorm, after its embeddings' sum) come last
        st.late_grad = sum(it.bytes for it in outside if not is_head(it.name) and not is_token_embedding(it.name))
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
