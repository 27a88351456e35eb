"""BERT's blocks' backward as node moments: the ``backward`` (last block) and ``backward_first_block`` phases.

A post-LN BERT layer (``transformers/models/bert/modeling_bert.py`` ``BertLayer``: attention, ``BertSelfOutput``
``LayerNorm(dropout(dense(h)) + input)``, ``BertIntermediate`` dense + GELU, ``BertOutput`` the same sum and norm)
runs its backward node by node (``torch/csrc/autograd/engine.cpp``); each node makes its outputs, then releases its
saved tensors (``Node::release_variables``) and its input gradients. :func:`block_events` lists those allocations
and frees in order, in bytes; the phase is the largest running sum, beside the step's states, the gradients made
so far, the activations still saved and the loss and its seed gradient. Per node (derivatives.yaml):

* a LayerNorm (``native_layer_norm_backward``): its input gradient and the weight's and bias's; it frees its input
  (the residual sum), mean and rstd and the output gradient;
* a dropout (``native_dropout_backward``: ``grad * mask * scale``): one tensor, the mask freed;
* a linear (``AddmmBackward0``: ``mm_mat1_backward``, ``mm_mat2_backward``, the bias's ``sum``): the input's,
  weight's and bias's gradients; its saved input freed. Its input gradient is freed by its one reader's node (GELU's,
  the attention core's first). A real CPU step (``LiveStorages``) shows it; the fake trace held it to the next
  residual sum until its ``ModTracker`` multi-grad hooks stopped buffering gradients
  (/tmp/prompts/patch-bert-2.diff, trace/mod_tracker_hooks.py: ``BertOutput(hidden_states, input_tensor)``'s
  all-mode hook kept the first input's gradient until the second's arrived);
* GELU (``gelu_backward``): one tensor of the intermediate size, its saved input freed;
* the residual sums: autograd adds the two gradients reaching one input (``input_buffer.cpp``), then frees both;
* the attention core, PyTorch's math SDPA (``attention.cpp`` ``_scaled_dot_product_attention_math``, CPU with
  attention dropout): 16-bit q, k, v run in fp32, so the output gradient is upcast (``ToCopyBackward0``); where B
  and A cannot fold into bmm's batch as a view (B > 1, A > 1: ``_matmul_impl``'s reshape) a contiguous copy of the
  gradient is made. P·V's ``BmmBackward0`` makes the value's and the weights' gradients (the step's top in 16 bits),
  then frees value_acc and the dropout's output; the dropout's and the softmax's nodes follow, Q·Kᵀ's makes the
  scaled q's and k's gradients, the scale ``mul`` nodes theirs, and in 16 bits the casts back
  (``ToCopyBackward0``). Each projection's input gradient is a (B, S, A, hd) transpose, copied to be flattened but
  for the key's at B = 1 (its (A, hd) axes merge: a strided view).

Under ``--recompute full`` a layer's backward starts with its checkpoint's recomputed forward
(``torch/utils/checkpoint.py``), whose moments are the forward's (estimate/encoder_forward.py: the math attention's
output cast, the output LayerNorm with the dropout's output bound) on top of the other layers' checkpoints; its nodes
then run on the recomputed set (``recomputed``: the inventory without checkpointing), the recomputed LayerNorm output
kept by nothing.

Where checked: ``tests/estimate/test_encoder_backward.py`` (a tiny BERT's mlm, seq-cls and token-cls heads in fp32
and bf16, B1/B2 x S32/S64, --recompute none and full: the step's peak == a CPU fake-tensor trace's). Read for BERT
under the hf profile on one device, eager, no autocast, no fine-tuning, no offload, the math attention kernel
with dropout (BERT's default 0.1), on CPU (where checked), without gradient accumulation; ``phases`` unchanged
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.encoder_forward import core_transients, norm_transients
from trainmem.estimate.phase import Phase
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["with_encoder_backward", "block_events", "BlockDims", "peak_of", "layer_saved"]

#: the backward phases' parts that are not the block's (the model states, buffers)
_STATIC = ("parameters", "master_weights", "optimizer_states", "buffers")


@dataclass(frozen=True, kw_only=True)
class BlockDims:
    """One BERT layer's sizes: tokens ``B``·``S``, ``H`` hidden, ``F`` intermediate, ``A`` heads; ``act`` the
    activations' and ``param`` the parameters' (and their gradients') dtype bytes."""

    B: int
    S: int
    H: int
    F: int
    A: int
    act: float
    param: float


def block_events(saved: dict[str, int], d: BlockDims, *, input_name: str) -> list[tuple[str, str, int]]:
    """One BERT layer's backward from its output LayerNorm's gradient on, as (kind, label, bytes) in order: kind
    ``work`` (a transient gradient, + made / − freed), ``grad`` (a parameter's gradient made) or ``saved`` (a
    saved tensor freed, bytes > 0). ``saved``: the layer's saved tensors' bytes by name under the layer
    (``attention.self.q``...); ``input_name``: the saved layer input's key (freed at the query projection)."""
    B, S, H, F, A, a, p = d.B, d.S, d.H, d.F, d.A, d.act, d.param
    up, fold = a != 4, B > 1 and A > 1
    bsh, bsf, bass = int(B * S * H * a), int(B * S * F * a), B * A * S * S * 4
    bhd4 = B * S * H * 4  # a (B, A, S, hd) fp32 tensor of the math kernel
    ev: list[tuple[str, str, int]] = []

    def work(label, n):
        ev.append(("work", label, n))

    def free(name):
        ev.append(("saved", name, saved.get(name, 0)))

    def grads(label, n):
        ev.append(("grad", label, int(n * p)))

    def norm(prefix, g_out):  # native_layer_norm_backward, then its saved input, mean and rstd freed
        work(f"{prefix}.LayerNorm input grad", bsh)
        grads(f"{prefix}.LayerNorm weight, bias", 2 * H)
        work("output grad freed", -g_out)
        for k in (".residual", ".LayerNorm.mean", ".LayerNorm.rstd"):
            free(prefix + k)

    work("block output grad", bsh)
    norm("output", bsh)
    work("output.dropout grad", bsh)
    free("output.dropout.mask")
    work("output.dense input grad", bsf)
    grads("output.dense weight, bias", F * H + H)
    work("output.dropout grad freed", -bsh)
    free("intermediate.intermediate_act_fn.out")
    work("gelu grad", bsf)
    work("output.dense input grad freed", -bsf)
    free("intermediate.dense.out")
    work("intermediate.dense input grad", bsh)
    grads("intermediate.dense weight, bias", F * H + F)
    work("gelu grad freed", -bsf)
    free("attention.output.LayerNorm.out")
    work("residual sum", bsh)
    work("the sum's addends freed", -bsh - bsh)
    norm("attention.output", bsh)
    work("attention.output.dropout grad", bsh)
    free("attention.output.dropout.mask")
    work("attention.output.dense input grad", bsh)
    grads("attention.output.dense weight, bias", H * H + H)
    work("attention.output.dropout grad freed", -bsh)
    free("attention.self.attn_out")
    # P·V's backward on the output gradient: its fp32 upcast, its fold copy (the upcast then freed)
    if up:
        work("the output grad's fp32 upcast", bhd4)
        work("attention.output.dense input grad freed", -bsh)
    if fold:
        work("the output grad's fold copy", bhd4)
        work("the upcast freed" if up else "attention.output.dense input grad freed", -bhd4 if up else -bsh)
    work("value_acc grad", bhd4)
    work("attention weights grad", bass)
    work("the output grad's copy freed" if up or fold else "attention.output.dense input grad freed",
         -bhd4 if up or fold else -bsh)
    free("attention.self.v_repeat")
    free("attention.self.attn_dropout")
    work("dropout grad", bass)
    work("weights grad freed", -bass)
    free("attention.self.attn_dropout_mask")
    work("softmax grad", bass)
    work("dropout grad freed", -bass)
    free("attention.self.softmax")
    work("scaled k grad", bhd4)
    work("scaled q grad", bhd4)
    work("softmax grad freed", -bass)
    free("attention.self.k_t")
    free("attention.self.q")
    for x in ("k", "q"):  # the scale's mul nodes, one after the other
        work(f"{x} grad", bhd4)
        work(f"scaled {x} grad freed", -bhd4)
    g = int(bhd4 * a / 4)  # a projection output's gradient (the fp32 one, or its 16-bit cast)
    if up:
        for x in ("v", "k", "q"):
            work(f"{x} grad cast", g)
            work(f"{x} fp32 grad freed", -bhd4)
    for x in ("value", "key", "query"):
        copied = x != "key" or fold
        if copied:
            work(f"{x} grad flattened copy", bsh)
            work(f"{x} grad freed", -g)
        work(f"{x} input grad", bsh)
        grads(f"{x} weight, bias", H * H + H)
        work(f"{x} grad freed" if not copied else f"{x} copy freed", -(g if not copied else bsh))
        if x == "query":
            free(input_name)
        work("the block input's grad sum", bsh)
        work("the sum's addends freed", -2 * bsh)
    return ev


def peak_of(events: list[tuple[str, str, int]]) -> tuple[int, int, int, int, str]:
    """The largest running sum of ``events``: (work, gradients made, saved freed, total, label) at it."""
    work = made = freed = 0
    best = (0, 0, 0, 0, "")
    for kind, label, n in events:
        if kind == "work":
            work += n
        elif kind == "grad":
            made += n
        else:
            freed += n
        if work + made - freed > best[3]:
            best = (work, made, freed, work + made - freed, label)
    return best


def modelled(model: ModelSpec, step: StepSpec, impl: ImplSpec, kernel: str, finetune=None) -> bool:
    return (family_of(model).rules.forward == "bert" and model.arch == "encoder" and impl.profile == "hf"
            and impl.framework == "hf" and impl.device == "cpu" and model.attn_dropout > 0 and model.hidden_dropout > 0
            and not impl.compile and impl.recompute in ("none", "full")
            and finetune is None and not step.dtypes.autocast and kernel == "math" and step.grad_accum == 1
            and not impl.optimizer_in_backward and model.num_layers > 1)


def layer_saved(items: list[MemoryItem], li: int) -> dict[str, int]:
    """Layer ``li``'s saved tensors' bytes by their name under the layer (``attention.self.q``...)."""
    key = f".layer.{li}."
    return {i.name.split(key, 1)[1]: i.bytes for i in items
            if i.category is Category.ACTIVATION and key in i.name}


def recompute_moments(saved: dict[str, int], *, B: int, S: int, H: int, A: int, act: str) -> list[tuple[int, str]]:
    """A checkpointed layer's recomputed forward (``torch/utils/checkpoint.py``: the block's forward again, its
    saved tensors kept for its backward) at the moments estimate/encoder_forward.py reads in the forward: the math
    attention's output cast and the output LayerNorm's (its output not kept: no later node is recomputed). (bytes
    alive beyond the layer's saved set so far, label)."""
    names = list(saved)
    cut = names.index("attention.self.attn_out") if "attention.self.attn_out" in names else len(names)
    core = sum(saved[n] for n in names[:cut]) + sum(core_transients(B=B, S=S, H=H, A=A, act=act).values())
    nt = norm_transients(B=B, S=S, H=H, act=act, compute=act)
    norm = sum(saved.values()) + nt["dropout_output"] + (0 if "output.LayerNorm.out" in saved else nt["norm_output"])
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
                     act=dtype_bytes(d.compute), param=dtype_bytes(d.param))
    lsm = next((i for i in items if i.name == "loss.log_softmax"), None)
    scalars = 2 * dtype_bytes(lsm.dtype) if lsm is not None and step.loss == "ce" else 0
    bsh = int(step.batch * step.seq * model.hidden_size * dims.act)  # the layer output's gradient
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
                                                 A=model.num_heads, act=d.compute):
                at = {**static, "gradients": p.parts.get("gradients", 0),
                      "activations": p.parts.get("activations", 0), "recomputed": alive, "node_work": bsh + scalars}
                if sum(at.values()) > sum(parts.values()):
                    parts, note = at, f"backward of block {li}, at its {what}"
        out[k] = Phase(name, sum(parts.values()), parts, f"{note}: the gradients so far, the saved tensors left, "
                       "the node's gradients (estimate/encoder_backward.py)")
    return out
