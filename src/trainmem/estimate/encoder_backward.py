"""BERT's blocks' backward as node moments: the ``backward`` (last block) and ``backward_first_block`` phases.

A post-LN BERT layer (``transformers/models/bert/modeling_bert.py`` ``BertLayer``: attention, ``BertSelfOutput``
``LayerNorm(dropout(dense(h)) + input)``, ``BertIntermediate`` dense + GELU, ``BertOutput`` the same sum and norm)
runs its backward node by node (``torch/csrc/autograd/engine.cpp``); estimate/encoder_nodes.py lists its allocations
and frees in order; the phase is their largest running sum, beside the step's states, the gradients made so far, the
activations still saved and the loss and its seed gradient. A linear's input gradient dies at its one reader's node,
as a real CPU step (``LiveStorages``) shows; the fake trace held it to the next residual sum while its ``ModTracker``
all-mode multi-grad hooks buffered gradients (``BertOutput(hidden_states, input_tensor)``'s hook kept the first
input's gradient until the second's arrived); its hooks now hold none (trace/mod_tracker_hooks.py).

Under ``--recompute full`` a layer's backward starts with its checkpoint's recomputed forward
(``torch/utils/checkpoint.py``), whose moments are the forward's (estimate/encoder_forward.py: the math attention's
output cast, the output LayerNorm with the dropout's output bound) on top of the other layers' checkpoints; its nodes
then run on the recomputed set (``recomputed``: the inventory without checkpointing), the recomputed LayerNorm output
kept by nothing.

Where checked: ``tests/estimate/test_encoder_backward.py`` (a tiny BERT's mlm, seq-cls and token-cls heads in fp32,
bf16 and amp-bf16, B1/B2 x S32/S64, --recompute none and full: the step's peak == a CPU fake-tensor trace's; four
against a real CPU step). Read for BERT under the hf profile on one device, eager, no fine-tuning, no offload, the
math attention kernel with dropout (BERT's default 0.1), on CPU (where checked), without gradient accumulation;
``phases`` unchanged otherwise.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.encoder_forward import core_transients, norm_transients
from trainmem.estimate.encoder_nodes import BlockDims, block_events, peak_of
from trainmem.estimate.phase import Phase
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["with_encoder_backward", "layer_saved", "recompute_moments"]

#: the backward phases' parts that are not the block's (the model states, buffers)
_STATIC = ("parameters", "master_weights", "optimizer_states", "buffers")


def modelled(model: ModelSpec, step: StepSpec, impl: ImplSpec, kernel: str, finetune=None) -> bool:
    return (family_of(model).rules.forward == "bert" and model.arch == "encoder" and impl.profile == "hf"
            and impl.framework == "hf" and impl.device == "cpu" and model.attn_dropout > 0 and model.hidden_dropout > 0
            and not impl.compile and impl.recompute in ("none", "full")
            and finetune is None and kernel == "math" and step.grad_accum == 1

            and not impl.optimizer_in_backward and model.num_layers > 1)


def layer_saved(items: list[MemoryItem], li: int) -> dict[str, int]:
    """Layer ``li``'s saved tensors' bytes by their name under the layer (``attention.self.q``...)."""
    key = f".layer.{li}."
    return {i.name.split(key, 1)[1]: i.bytes for i in items
            if i.category is Category.ACTIVATION and key in i.name}


def recompute_moments(saved: dict[str, int], *, B: int, S: int, H: int, F: int, A: int, act: str,
                      compute: str) -> list[tuple[int, str]]:
    """A checkpointed layer's recomputed forward (``torch/utils/checkpoint.py``: the block's forward again, its
    saved tensors kept for its backward) at the moments estimate/encoder_forward.py reads in the forward: the math
    attention's output cast and the output LayerNorm's (its output not kept: no later node is recomputed). Under
    autocast (``act`` 16-bit, ``compute`` fp32; the checkpoint re-enters the forward's autocast state) the layer's
    fp32 attention output is bound at the LayerNorm, and autocast's cache holds the 16-bit bias casts of the linears
    run so far (``cached_cast``), which no node saves. (bytes alive beyond the layer's saved set so far, label)."""
    names = list(saved)
    cut = names.index("attention.self.attn_out") if "attention.self.attn_out" in names else len(names)
    amp, bsh4, low = act != compute, B * S * H * 4, dtype_bytes(act)
    core = sum(saved[n] for n in names[:cut]) + sum(core_transients(B=B, S=S, H=H, A=A, act=act).values())
    nt = norm_transients(B=B, S=S, H=H, act=act, compute=compute)
    norm = sum(saved.values()) + nt["dropout_output"] + (0 if "output.LayerNorm.out" in saved else nt["norm_output"])
    if amp:
        core += int(3 * H * low)  # q, k, v's bias casts
        norm += bsh4 + int((5 * H + F) * low)  # attention_output; every bias cast of the layer
    return [(core, "recomputed attention output cast"), (norm, "recomputed output LayerNorm")]


def with_encoder_backward(phases: list[Phase], items: Inventory, model: ModelSpec, step: StepSpec, impl: ImplSpec,
                          kernel: str, finetune=None, recomputed: Inventory | None = None) -> list[Phase]:
    """``phases`` whose ``backward`` and ``backward_first_block`` are the last and first layers' node moments (the
    module docstring) in place of the block working set. ``kernel``: the attention kernel (``kernel_for``);
    ``recomputed``: under ``--recompute full``, the inventory without checkpointing (a layer's recomputed set)."""
    if not modelled(model, step, impl, kernel, finetune) or (impl.recompute == "full") != (recomputed is not None):
        return phases
    d = step.dtypes
    dims = BlockDims(B=step.batch, S=step.seq, H=model.hidden_size, F=model.ffn_size, A=model.num_heads,
                     act=dtype_bytes(d.activation if d.autocast else d.compute), param=dtype_bytes(d.param),
                     norm=dtype_bytes(d.compute))
    lsm = next((i for i in items if i.name == "loss.log_softmax"), None)
    scalars = 2 * dtype_bytes(lsm.dtype) if lsm is not None and step.loss == "ce" else 0
    bsh = int(step.batch * step.seq * model.hidden_size * dims.norm)  # the layer output's gradient
    last, out = model.num_layers - 1, list(phases)
    for name, li in (("backward", last), ("backward_first_block", 0)):
        k = next((n for n, p in enumerate(out) if p.name == name), None)
        if k is None:
            continue
        p = out[k]
        saved = layer_saved(block_items(recomputed if recomputed is not None else items, li), li)
        prev = f"layer.{li - 1}.output.LayerNorm.out" if li else "embeddings.dropout.out"
        inp = next((i.bytes for i in items if i.name.endswith(prev) and i.category is Category.ACTIVATION), 0)
        work, made, freed, _, label = peak_of(block_events({**saved, "input": inp}, dims, input_name="input"))
        # the layer's output LayerNorm output: released by the reader after the block (the head's first linear,
        # the next layer's q/k/v projections) before this block's backward starts; a checkpointed layer's
        # recomputed one is kept by nothing
        norm_out = saved.get("output.LayerNorm.out", 0)
        static = {k2: v for k2, v in p.parts.items() if k2 in _STATIC}
        # a checkpointed layer's saved set is recomputed first, beside the other layers' checkpoints
        acts = p.parts.get("activations", 0) + (sum(saved.values()) if recomputed is not None else 0)
        parts = {**static, "gradients": p.parts.get("gradients", 0) + made,
                 "activations": acts - norm_out - freed, "node_work": work + scalars}
        note = f"backward of block {li}, at its node '{label}'"
        if recomputed is not None:
            for alive, what in recompute_moments(saved, B=step.batch, S=step.seq, H=model.hidden_size,
                                                 F=model.ffn_size, A=model.num_heads,
                                                 act=d.activation if d.autocast else d.compute, compute=d.compute):
                at = {**static, "gradients": p.parts.get("gradients", 0),
                      "activations": p.parts.get("activations", 0), "recomputed": alive, "node_work": bsh + scalars}
                if sum(at.values()) > sum(parts.values()):
                    parts, note = at, f"backward of block {li}, at its {what}"
        out[k] = Phase(name, sum(parts.values()), parts, f"{note}: the gradients so far, the saved tensors left, "
                       "the node's gradients (estimate/encoder_backward.py)")
    return out
