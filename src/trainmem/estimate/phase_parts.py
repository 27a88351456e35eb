"""The pieces every phase of estimate/peak.py is built from: the step's sums read off the items
(:class:`StepSums`), the phases so far with the buffers alive in each (:class:`Timeline`), and the
item readers and part splits the loss, block and end moments share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmem.estimate.grad_items import head_weight_grad
from trainmem.estimate.heads import CALLER_LABELS
from trainmem.estimate.layer_stats import LayerStats, layer_stats
from trainmem.estimate.phase import Phase
from trainmem.estimate.phase_inputs import PhaseInputs
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import is_embedding, is_embedding_indices, is_head, is_token_embedding, layer_of

__all__ = ["StepSums", "Timeline"]


@dataclass(frozen=True)
class StepSums:
    """The ledgers and per-block sums of a step's items that every phase reads."""

    st: LayerStats
    G: int
    """Every gradient item."""
    A: int
    """Every activation item."""
    stored_G: int
    """Gradients that outlive their hook: none with the optimizer in backward."""
    tied_sum: int
    """A tied weight's head gradient, which waits in backward for the embedding's: autograd sums the two
    before the weight's one AccumulateGrad node (and its hook) runs."""
    tied_G: int
    """... and, with the optimizer in backward, is stepped and freed: the tied head gradient, else 0."""
    g_acc: int
    """Gradients alive in forward: every one under accumulation (from the second micro-batch on)."""
    grads_head: int
    """The non-layer gradients produced before the blocks' backward, taken as the head's (everything outside
    blocks but the embedding, which a tied head produces early anyway)."""
    static: dict[str, int]
    """Resident all step: parameters, master weights, optimizer states, the model's registered buffers
    (estimate/buffers.py)."""
    router_grads: dict[int, int]
    """The load-balancing loss's router-logit gradients per block, in the logits' dtype (the LM head's)."""
    BSV: int

    @classmethod
    def of(cls, items: "Inventory | list[MemoryItem]", inp: PhaseInputs) -> "StepSums":
        st = layer_stats(items, inp.stacks)
        by_cat = st.by_cat
        G = by_cat.get(Category.GRADIENT, 0)
        tied_sum = head_weight_bytes(items) if inp.tied_head and inp.loss != "none" else 0
        return cls(
            st=st, G=G, A=by_cat.get(Category.ACTIVATION, 0),
            stored_G=0 if inp.optimizer_in_backward else G, tied_sum=tied_sum,
            tied_G=tied_sum if inp.optimizer_in_backward else 0,
            g_acc=G if inp.grad_accum > 1 else 0,
            grads_head=G - sum(st.grad_layer.values()) if st.grad_layer else G,
            static={"parameters": by_cat.get(Category.PARAMETER, 0),
                    "master_weights": by_cat.get(Category.MASTER_WEIGHT, 0),
                    "optimizer_states": by_cat.get(Category.OPTIMIZER_STATE, 0),
                    "buffers": by_cat.get(Category.BUFFER, 0)},
            router_grads={li: n * dtype_bytes(inp.logits_dtype) for li, n in st.router_rows.items()},
            BSV=inp.batch * inp.seq * inp.vocab)

    def loss_scalars(self, inp: PhaseInputs) -> int:
        """The loss and its seed gradient (``ones_like``), alive through backward under plain CE."""
        return 2 * dtype_bytes(inp.loss_dtype) if inp.loss == "ce" else 0


class Timeline:
    """The phases so far. A phase is the static states, its own parts and the buffers alive then: the
    ``persistent`` ones, the phase's ``working`` ones and the caller's token ids (:func:`caller_ids`; in the
    optimizer phase ``PhaseInputs.optimizer_batch``)."""

    def __init__(self, items, inp: PhaseInputs, sums: StepSums) -> None:
        self.persistent = {k: v for k, v in (inp.persistent or {}).items() if v}
        self.working = inp.working_by_phase()
        self.static = sums.static
        self.ids = caller_ids(items)
        self.optimizer_batch = inp.optimizer_batch
        self.out: list[Phase] = []

    def add(self, name: str, parts: dict[str, int], note: str, own: dict[str, int] | None = None) -> None:
        """Append phase ``name``; ``own``: the buffers alive there instead of the phase's ``working`` ones."""
        bufs = {**self.persistent, **{k: v for k, v in (self.working.get(name, {}) if own is None else own).items()
                                      if v}}
        if self.ids and name != "optimizer":  # the caller's token ids (caller_ids), where activations are counted
            bufs["caller_ids"] = self.ids
        if self.optimizer_batch and name == "optimizer":  # the caller's batch, which no activation counts there
            bufs["caller_ids"] = self.optimizer_batch
        full = {**self.static, **{k: v for k, v in parts.items() if v}, **bufs}
        self.out.append(Phase(name, sum(full.values()), full, note))

    def keep_larger(self, at: int) -> None:
        """Replace the phase at index ``at`` by the larger of it and the last phase, which is removed."""
        self.out[at] = max(self.out[at], self.out.pop(), key=lambda p: p.bytes)

    def node_moments_off(self, node_moments: bool) -> bool:
        """Whether the block working set alone stands (a distributed working set, without node moments)."""
        return node_moments_off(self.working, node_moments)


def node_moments_off(working: dict, node_moments: bool) -> bool:
    """Whether the block working set alone stands (a distributed working set, without node moments)."""
    return bool(working.get("backward")) and not node_moments


def stored_and_new(grads: int, stored: int) -> dict:
    """A node moment's gradients: at most every gradient item (``gradients``); beyond them, gradients that are
    not items (``new_gradients``): under accumulation the block's new ones beside their stored ``.grad``, under
    FSDP the unsharded ones before their reduce-scatter. The split keeps the sum; it names what is not an item."""
    return {"gradients": min(grads, stored), "new_gradients": grads - min(grads, stored)}


def held_and_recomputed(held: int, recomputed: int, freed: int) -> dict:
    """A node moment's activations: what the step holds as items (``activations``) and a checkpointed block's
    recomputed set (``recomputed``, not items), less what the block's nodes freed by then, taken from the
    recomputed set first (its own saved tensors are what its backward frees)."""
    rec_left = max(0, recomputed - freed)
    return {"activations": held - (freed - (recomputed - rec_left)), "recomputed": rec_left}


def _base(items) -> list[MemoryItem]:
    return items.base if isinstance(items, Inventory) else items


def largest_block_grad(items) -> int:
    """The largest gradient inside the blocks (templates included)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    grads = [i for i in (*inv.base, *(i for r in inv.repeats for i in r.items)) if i.category is Category.GRADIENT]
    return max((i.bytes for i in grads if layer_of(i.name) is not None), default=0)


def shared_block_inputs(items) -> int:
    """Saved tensors outside the blocks that only the blocks read (rotary cos/sin): neither the
    embedding's nor the head's, nor a classifier's labels, which the caller holds all step (``heads.CALLER_LABELS``:
    tiny BERT token-cls B1 S32 read them freed, the end of backward 256 B under the trace)."""
    return sum(i.bytes for i in _base(items) if i.category is Category.ACTIVATION and layer_of(i.name) is None
               and not is_head(i.name) and not is_embedding(i.name) and not is_embedding_indices(i.name)
               and i.name != CALLER_LABELS)


def embedding_outputs(items) -> int:
    """What an embedding's scope keeps besides its indices: its output, kept by the first block
    (``model.embed_tokens.out``; Gemma's scaled output and its scale), freed before the embedding's
    own backward runs. Every profile names them so (:func:`trainmem.names.embedding_output`)."""
    return sum(i.bytes for i in _base(items) if i.category is Category.ACTIVATION and layer_of(i.name) is None
               and is_embedding(i.name) and not is_embedding_indices(i.name))


def caller_ids(items) -> int:
    """The caller's token ids (B, S) int64 that a frozen token embedding does not save: the caller holds its
    batch all step (``trace/step.py`` ``one_step``: ``inputs``; ``measure/workload.py``: ``Workload.ids``),
    and a trainable embedding saves that very tensor (its ``indices``, counted as an activation), a frozen one
    nothing (``estimate/finetune.py`` ``embedding_notes``: a zero-byte item with the ids' shape), unless another node
    keeps them (BERT's MLM loss: ``labels.view(-1)``, an item of the same name). Counted in the
    phases that count activations; in the optimizer phase, where no activation is left, the caller's whole batch
    is counted instead, frozen embedding or not (``PhaseInputs.optimizer_batch``)."""
    kept = {i.name for i in _base(items) if i.category is Category.ACTIVATION and i.bytes}  # another node keeps them
    return sum(math.prod(i.shape) * 8 for i in _base(items) if i.category is Category.ACTIVATION and i.bytes == 0
               and is_token_embedding(i.name) and is_embedding_indices(i.name) and i.name not in kept)


def later_embedding_indices(items) -> int:
    """The ids kept by embeddings other than the token embedding (GPT-2's learned positions): they
    run after it in forward, so their backward nodes run (and free them) before its own."""
    return sum(i.bytes for i in _base(items) if i.category is Category.ACTIVATION and is_embedding_indices(i.name)
               and not is_token_embedding(i.name))


def head_weight_bytes(items) -> int:
    """The output layer's weight gradient bytes (estimate/grad_items.py), 0 when that weight is frozen."""
    g = head_weight_grad(items)
    return g.bytes if g else 0
