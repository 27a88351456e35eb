"""Moments inside a block's backward: its RMSNorms' and its gated MLP product's (phases ``backward``
and ``backward_first_block`` take the larger of these and their block working set).

The ``backward`` phase holds a block's working set as one residual-sized gradient plus the gradient
of its largest saved tensor. A Llama-style RMSNorm in 16-bit (``LlamaRMSNorm.forward``: ``x.to(float32)``,
``pow(2).mean(-1)``, ``rsqrt``, ``x * rsqrt``, ``.to(dtype)``, ``weight * ...``) runs its backward op
by op, every intermediate fp32, and its last node (``PowBackward0``: ``grad * 2 * x.pow(1)``,
``torch/csrc/autograd/FunctionsManual.cpp`` ``pow_backward``) runs while

* the gradient of ``x * rsqrt`` with respect to ``x`` waits in ``x``'s input buffer (autograd sums
  the two paths into ``x.to(float32)`` when both arrived: ``torch/csrc/autograd/input_buffer.cpp``),
* the mean's gradient (``MeanBackward``: expand and divide, a full fp32 tensor) is its input,
* ``x.pow(1)``, ``2 * x.pow(1)`` and their product with the gradient are made,

five fp32 tensors of the norm's input size, beside the residual stream's gradient (the block output's
gradient passes the residual add unchanged and waits for the norm's). By then the MLP's backward has
run: its saved tensors and the norm's ``rsqrt``, ``normed_cast`` and ``out`` were freed after their
nodes ran (``torch/csrc/autograd/engine.cpp``, ``Node::release_variables`` after ``call_function``),
and ``AccumulateGrad`` has made the MLP's and the norm's weight gradients (``.grad`` on first
accumulation). The norm's fp32 input copy is still saved (the pow node reads it).

The gated MLP's ``act_fn(gate) * up`` backward is the other moment (:func:`_gated_mlp`). With a small
hidden state against the vocabulary (the head's weight gradient large, the loss's tensors small) one
of them is the step's top; they are not modelled for other norms, MoE blocks, under op-level recompute,
or when gradients are stepped in backward. Under ``--recompute full`` they are read on the block's
recomputed tensors (``recomputed``: the inventory without checkpointing).

Blocks without an RMSNorm get the linear nodes' moments, read from registries of saved-tensor layouts
(:data:`_MLPS`, :data:`_INPUT_PROJECTIONS`): GPT-NeoX's MLP (the down projection's end, ``GeluBackward0``,
the up projection's end) and its fused ``query_key_value``'s end; under autocast each linear's top is
its weight copy's ``ToCopyBackward0`` (:func:`_cast_weight_moment`), and a parallel-residual block keeps
the attention branch's bf16 output gradient waiting through the MLP's (:func:`_parallel_branch_gradient`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.estimate.quant4bit_moments import four_bit_mlp_moments
from trainmem.estimate.recompute_stop import adapter_down_moments, adapter_up_forward, recompute_stop_moment
from trainmem.names import layer_of, split_block

# the block moments (the gated MLP's product, each RMSNorm), and the norm layout grad_accum.py reads
__all__ = ["norm_backward_parts", "final_norm_moment", "llama_norm_indices", "block_items", "checkpoint_kept",
           "node_moments_modelled", "FP32_NORM_TRANSIENTS", "OTHER_NORM_KINDS"]

_NORM = ("x_fp32", "rsqrt", "normed_cast", "out")  # a Llama-style RMSNorm's saved tensors, in order
_NORM_TRACED = ("_to_copy", "rsqrt", "_to_copy_1", "mul")  # the same, named by --profile traced's ops
#: saved by the other RMSNorm variants (Gemma's 1 + w, OLMo-2's and gpt-oss' cast-last): not modelled here
OTHER_NORM_KINDS = ("one_plus_w", "out_fp32")


@dataclass(frozen=True, kw_only=True)
class MlpNodes:
    """An MLP whose backward's last nodes are modelled: its saved tensors in forward order, ending with
    the down projection's saved input, and what that input's node returns."""

    saved: tuple[str, ...]  # names under ``.mlp.``
    down: str  # the down projection's child name
    tail: tuple[str, ...] = ()  # saved inside the MLP after it (GPT-2's dropout mask)
    #: the gradients the node that made the down projection's input returns: MulBackward0's two
    #: (derivatives.yaml ``mul.Tensor``: ``grad * other``, ``grad * self``), GeluBackward0's one
    #: (``gelu``: ``gelu_backward(grad, self, approximate)``, its output freed, its input still saved)
    act_grads: int = 2
    up: str | None = None  # the one up projection whose backward ends the MLP's, where modelled
    #: under autocast the down projection's bias copy is cast back before its weight copy: GPT-2's Conv1D
    #: (``torch.addmm(bias, x, weight)``); ``nn.Linear`` casts its weight's first. The casts' backward nodes
    #: run in the order the op's autocast wrapper made them (argument order), as the traces show
    bias_first: bool = False
    #: the down projection saved its input (the product). A frozen one (LoRA) saves only its weight
    #: (derivatives.yaml ``mm``: ``self`` is kept for ``mat2``'s gradient alone), so its node frees nothing
    #: and the last saved tensor (``up_proj``'s output, which MulBackward0 reads) is still held at the top
    down_saves_input: bool = True
    #: under autocast, the end of the down projection's own node is a moment too (checked for GPT-BigCode's
    #: nn.Linear c_proj after a sequential residual): its bf16 input and weight gradients made, its saved input
    #: and weight copy not yet released, the bf16 cast of its output gradient alive (tests/estimate/test_gpt_bigcode.py)
    down_node_end: bool = False


_MLP = ("gate_proj.out", "act_fn.out", "up_proj.out", "act_mul_up")  # a Llama MLP's saved tensors
#: the same four as ``--profile traced`` names them (estimate/traced: by the op that made each)
_MLP_TRACED = ("gate_proj.mm", "act_fn.silu", "up_proj.mm", "mul")
_MLPS = (MlpNodes(saved=_MLP, down="down_proj"), MlpNodes(saved=_MLP_TRACED, down="down_proj"),
         MlpNodes(saved=("c_fc.out", "act.tanh", "act.one_plus_tanh", "act.half_x", "act.out"), down="c_proj",
                  tail=("dropout.mask",), bias_first=True),
         # GPT-NeoX (``GPTNeoXMLP``: dense_h_to_4h, exact GELU, dense_4h_to_h)
         MlpNodes(saved=("dense_h_to_4h.out", "act.out"), down="dense_4h_to_h", act_grads=1,
                  up="dense_h_to_4h"),
         # GPT-BigCode (``GPTBigCodeMLP``: nn.Linear c_fc, one F.gelu, c_proj, nn.Dropout)
         MlpNodes(saved=("c_fc.out", "act.out"), down="c_proj", tail=("dropout.mask",), act_grads=1, up="c_fc",
                  down_node_end=True),
         # Phi-3 (``Phi3MLP.forward``, modeling_phi3.py: gate_up_proj, ``chunk(2, dim=-1)``, ``up * act(gate)``,
         # down_proj): the fused projection's output (both halves' views), the activation's, the product
         MlpNodes(saved=("gate_up_proj.out", "activation_fn.out", "act_mul_up"), down="down_proj"),
         # a Llama MLP with a frozen down projection (LoRA on the attention): no saved product
         MlpNodes(saved=_MLP[:3], down="down_proj", down_saves_input=False),
         # GPT-NeoX's, frozen (LoRA on query_key_value): the GELU output is not saved
         MlpNodes(saved=("dense_h_to_4h.out",), down="dense_4h_to_h", act_grads=1, up="dense_h_to_4h",
                  down_saves_input=False),
         # Phi-3's, frozen (LoRA on qkv_proj): the product is not saved
         MlpNodes(saved=("gate_up_proj.out", "activation_fn.out"), down="down_proj", down_saves_input=False),
         # GPT-2's, frozen (LoRA on c_attn): ``gelu_new``'s product is not saved
         MlpNodes(saved=("c_fc.out", "act.tanh", "act.one_plus_tanh", "act.half_x"), down="c_proj",
                  tail=("dropout.mask",), bias_first=True, down_saves_input=False))
FP32_NORM_TRANSIENTS = 5  # mul(x, rsqrt)'s x-gradient, the mean's gradient, pow(x, 1), 2·pow, their product


def norm_backward_parts(items: "Inventory | list[MemoryItem]", last: int, residual_bytes: int,
                        recomputed: "Inventory | None" = None) -> list[dict[str, int]]:
    """One moment per Llama-style RMSNorm of the last block, in forward order (the input norm, then
    the pre-MLP norm): ``block_gradients`` (the block's weight gradients made by
    then: those of the norm and of every child of the block after it), ``freed_activations`` (the
    block's saved tensors after the norm's fp32 input, to take off the activations) and
    ``work``. Empty when the block has another kind of norm or routed experts. ``recomputed``: the
    inventory without checkpointing, whose block tensors a checkpointed block recomputes before its
    nodes run (``--recompute full``)."""
    block = block_items(items, last)
    # fine-tuning's zero-byte markers (what a frozen layer does not save, estimate/finetune.py) are not tensors
    acts = [i for i in (block_items(recomputed, last) if recomputed is not None else block)
            if i.category is Category.ACTIVATION and i.bytes]
    if not node_moments_modelled(acts):
        return []
    checkpointed = recomputed is not None
    unsaved = [i for i in (block_items(recomputed, last) if checkpointed else block)
               if i.category is Category.ACTIVATION and not i.bytes]
    out = adapter_down_moments(block, acts, unsaved, residual_bytes=residual_bytes, checkpointed=checkpointed) + \
        (adapter_up_forward(block, acts, unsaved, residual_bytes=residual_bytes) if checkpointed else []) + \
        _gated_mlp(block, acts, residual_bytes, checkpointed=checkpointed, unsaved=unsaved) + \
        _input_projections(block, acts, residual_bytes, checkpointed=checkpointed) + \
        four_bit_mlp_moments(block, acts, residual_bytes=residual_bytes, checkpointed=checkpointed)  # QLoRA's dequant
    for at in llama_norm_indices(acts):
        after = acts[at:]
        children = {_child(i.name) for i in after}
        out.append({"block_gradients": sum(i.bytes for i in block
                                           if i.category is Category.GRADIENT and _child(i.name) in children),
                    "freed_activations": sum(i.bytes for i in after[1:]),
                    # the attention ran its backward: a first block's rope freed the shared cos/sin (a
                    # checkpointed block's frame holds them: _input_projections)
                    "after_attention": int(not checkpointed and
                                           any(c not in (_child(acts[at].name), "mlp") for c in children)),
                    "work": residual_bytes + FP32_NORM_TRANSIENTS * acts[at].bytes})
    if checkpointed and (kept := checkpoint_kept(items, last, acts)):
        out = [{**m, "freed_activations": m["freed_activations"] + kept} for m in out]
    return out


def node_moments_modelled(items) -> bool:
    """Whether the blocks' backward node moments are modelled for these items: not with another kind of norm
    (:data:`OTHER_NORM_KINDS`) or routed experts."""
    return not any(i.name.rpartition(".")[2] in OTHER_NORM_KINDS or ".experts." in i.name for i in items
                   if i.category is Category.ACTIVATION)


def checkpoint_kept(items: "Inventory | list[MemoryItem]", last: int, acts: list[MemoryItem]) -> int:
    """What checkpointed block ``last`` keeps that its recomputation (``acts``) does not make: its output, kept
    as the next block's checkpoint input (a 16-bit RMSNorm after it saves its own fp32 copy instead), which the
    next block's first node released when it unpacked it (not checked for a stage's last block, whose output a
    pipeline schedule holds: 0 there)."""
    if last >= _last_block(items):
        return 0
    made = {i.name for i in acts}
    return sum(i.bytes for i in block_items(items, last) if i.category is Category.ACTIVATION and i.name not in made)


@dataclass(frozen=True, kw_only=True)
class InputProjections:
    """A child's input projections reading one norm's output: the one whose backward runs last (forward
    runs it first) and the others, whose input gradients are summed before it runs."""

    child: str  # the block's child (its attention, its MLP)
    last: str
    others: tuple[str, ...] = ()
    attention: bool = True  # the child is the attention (its backward frees what the blocks share)


_INPUT_PROJECTIONS = (InputProjections(child="self_attn", last="q_proj", others=("k_proj", "v_proj")),
                      # GPT-NeoX's fused projection (``GPTNeoXAttention.query_key_value``, with a bias)
                      InputProjections(child="attention", last="query_key_value"),
                      # a gated MLP (``gate_proj(x)`` runs before ``up_proj(x)``)
                      InputProjections(child="mlp", last="gate_proj", others=("up_proj",), attention=False))


def _input_projections(block: list[MemoryItem], acts: list[MemoryItem], residual_bytes: int, *,
                       checkpointed: bool = False) -> list[dict[str, int]]:
    """The end of a child's first input projection's backward (``q_proj``, GPT-NeoX's fused
    ``query_key_value``, a gated MLP's ``gate_proj``: :data:`_INPUT_PROJECTIONS`; derivatives.yaml ``mm``:
    ``grad @ weight`` and ``x.T @ grad``, ``addmm``'s bias gradient ``sum_to`` in the engine's
    ``validate_outputs``). The gradients of the child and of every child after it exist (the projection's
    is new: ``accum_new_gradients`` beside its .grad from a second micro-batch); of the block's activations
    those from the child on were freed (after the attention's backward a first block's rope freed the shared
    cos/sin, unless the block is checkpointed: the non-reentrant checkpoint's frame keeps its inputs until
    the norm's saved tensors are unpacked, torch/utils/checkpoint.py ``_checkpoint_hook``). Alive besides, in
    one dtype: the residual gradient, the norm output's gradient summed so far from the others (v and k:
    ``InputBuffer::accumulate``, torch/csrc/autograd/input_buffer.cpp), the projection's output gradient
    (made contiguous for q's view backward: B·S·A·hd, GPT-NeoX's B·S·3H, gate's B·S·F) and its input gradient
    (B·S·H). In fp32 q_proj's is the first block's top when the weights outweigh the activations (no RMSNorm
    casts: ``llama_norm_indices`` finds no fp32 moment). Under autocast (the bf16 copies ``*_cast``) the top
    is the weight copy's ToCopyBackward0 after the projection's node released its saved copies
    (:func:`_cast_weight_moment`)."""
    if any("/tp" in d or "/cp" in d for i in acts for d in i.dims):
        return []  # checked on one device and data parallel: not with flat (FSDP, ZeRO) or TP/CP-cut tensors
    grads = [i for i in block if i.category is Category.GRADIENT]
    out = []
    for proj in _INPUT_PROJECTIONS:
        q = [i for i in grads if f".{proj.child}.{proj.last}." in i.name]
        first = next((k for k, i in enumerate(acts) if _child(i.name) == proj.child), None)
        weight = next((i for i in q if i.shape is not None and len(i.shape) == 2), None)
        if weight is None or not first or \
                not all(any(f".{proj.child}.{p}." in i.name for i in grads) for p in proj.others):
            continue
        children = {_child(i.name) for i in acts[first:]}
        at = {"block_gradients": sum(i.bytes for i in grads if _child(i.name) in children),
              "accum_new_gradients": sum(i.bytes for i in q), "freed_activations": sum(i.bytes for i in acts[first:]),
              "after_attention": int(proj.attention and not checkpointed)}
        cast = [i for i in acts if f".{proj.child}.{proj.last}." in i.name and i.name.endswith("_cast")]
        x = acts[first - 1]  # the norm's output, the projections' input (B, S, H), in one dtype
        if cast:
            # the norm output's gradient (the residual stream's shape and dtype: fp32, as the norm runs in it),
            # summed from each projection's input copy's ToCopyBackward0; the projection's bias not cast yet
            new, work = _cast_weight_moment(cast, q, weight)
            out.append({**at, "block_gradients": at["block_gradients"] - sum(i.bytes for i in q) + new,
                        "accum_new_gradients": new, "work": 2 * residual_bytes + work})
            out += _gated_other_cast(proj, at, acts, grads, q, cast, residual_bytes)
        elif x.shape and weight.shape[1] == x.shape[-1] and \
                not any(i.name.endswith("_cast") for i in acts if _child(i.name) == proj.child):
            if checkpointed:  # the bias gradient is made after the node freed its recomputed input (_gated_mlp)
                at["block_gradients"] -= sum(i.bytes for i in q) - weight.bytes
            q_out = x.bytes * weight.shape[0] // weight.shape[1]  # (B, S, A·hd) in the same dtype
            out.append({**at, "work": residual_bytes + (1 + bool(proj.others)) * x.bytes + q_out})
    return out


def _gated_other_cast(proj: InputProjections, at: dict[str, int], acts: list[MemoryItem], grads: list[MemoryItem],
                      q: list[MemoryItem], cast: list[MemoryItem], residual_bytes: int) -> list[dict[str, int]]:
    """Under autocast, a gated MLP's ``up_proj`` weight copy's ToCopyBackward0 (its node runs before
    ``gate_proj``'s: forward made gate's output first), one moment before gate's: MulBackward0's gradient for the
    activation's branch (the gate output's size, 16-bit) still waits for SiLU's node, which still holds its
    saved input (``gate_proj.out``), and gate_proj's copies are still saved; beside the residual gradient and
    up's input gradient (fp32, the norm output's so far), up's bf16 weight gradient and its new fp32 one; gate's
    gradient is not made. ``at``: gate's moment before its casts (:func:`_input_projections`)."""
    gate_out = next((i for i in acts if i.name.endswith(f".{proj.child}.{proj.last}.out")), None)
    if proj.attention or not proj.others or gate_out is None:
        return []
    other = f".{proj.child}.{proj.others[-1]}."
    u = [i for i in grads if other in i.name]
    weight = next((i for i in u if i.shape is not None and len(i.shape) == 2), None)
    ucast = [i for i in acts if other in i.name and i.name.endswith("_cast")]
    if weight is None or not ucast:
        return []
    new, work = _cast_weight_moment(ucast, u, weight)
    held = sum(i.bytes for i in cast) + gate_out.bytes
    return [{**at, "block_gradients": at["block_gradients"] - sum(i.bytes for i in (*q, *u)) + new,
             "accum_new_gradients": new, "freed_activations": at["freed_activations"] - held,
             "work": 2 * residual_bytes + gate_out.bytes + work}]


def _cast_weight_moment(cast: list[MemoryItem], grads: list[MemoryItem], weight: MemoryItem, *,
                        bias_first: bool = False) -> tuple[int, int]:
    """A linear's weight copy's ToCopyBackward0 under autocast, which casts the bf16 weight gradient to
    the fp32 weight's dtype while the bf16 one is alive (the linear's node released its saved copies):
    (the new fp32 gradients, the bf16 weight gradient and, for an ``addmm`` with a bias, the bias's bf16
    gradient, whose own cast runs next; ``bias_first``: it ran before, its fp32 gradient made)."""
    copy = sum(i.bytes for i in cast if i.name.endswith(".weight_cast"))
    bias = sum(i.bytes for i in grads) - weight.bytes
    return (weight.bytes + bias, copy) if bias_first else (weight.bytes, copy + bias * copy // weight.bytes)


def _gated_mlp(block: list[MemoryItem], acts: list[MemoryItem], residual_bytes: int, *,
               checkpointed: bool = False, unsaved: list[MemoryItem] = ()) -> list[dict[str, int]]:
    """The moments of an MLP's last nodes' backward, when the MLP is the block's last child
    (:data:`_MLPS`). The node that made the down projection's input: a Llama MLP's ``act_fn(gate) * up``
    and HF GPT-2's ``gelu_new`` (``NewGELUActivation.forward``: ``0.5 * x * (1 + tanh(...))``, the
    product of ``half_x`` and ``one_plus_tanh`` last) end on ``MulBackward0`` (two (B, S, F) gradients),
    GPT-NeoX's exact GELU on ``GeluBackward0`` (one). The down projection's input gradient (B, S, F) and
    weight gradient exist (Conv1D and ``nn.Linear`` with a bias: ``addmm`` backward's ``mm`` for each, and
    its bias gradient's ``sum``), its saved input (the product) was freed, the MLP's dropout mask too, and
    so was the block output a later node kept (``residual_mlp``: the final norm's input)."""
    # a Llama MLP under autocast keeps its linears' bf16 weight and input copies among its tensors: it is
    # matched without them (GPT-2's as it is)
    core = [i for i in acts if not i.name.endswith((".weight_cast", ".input_cast"))]
    for mlp in _MLPS:
        names, seq = mlp.saved, core
        ends = [k for k, i in enumerate(seq) if i.name.endswith(f".mlp.{names[-1]}")]
        if ends and ends[-1] >= len(names) - 1 and \
                [i.name.split(".mlp.", 1)[-1] for i in seq[ends[-1] + 1 - len(names):ends[-1] + 1]] == list(names):
            # the MLP's first saved tensor (its up projection's output) and its last, in ``acts``
            start, ends = acts.index(seq[ends[-1] + 1 - len(names)]), [acts.index(seq[ends[-1]])]
            break
    else:
        return []
    down, tail = mlp.down, mlp.tail
    weight_copy = sum(i.bytes for i in acts if i.name.endswith(f".mlp.{down}.weight_cast"))
    # after the MLP only its dropout mask and the block's residual adds (``residual_mlp``; traced: ``add``, ``add_1``)
    # (a frozen down projection under autocast saves its weight copy after the MLP's last tensor: not a tensor after it)
    copy_name = f".mlp.{down}.weight_cast"
    if any(not (_residual(_child(i.name) or "") or i.name.split(".mlp.", 1)[-1] in tail or i.name.endswith(copy_name))
           for i in acts[ends[-1] + 1:]):
        return []
    prod = acts[ends[-1]]  # the product (B, S, F); a frozen down projection's: up_proj's output, its size
    down_grads = [i for i in block if i.category is Category.GRADIENT and f".mlp.{down}." in i.name]
    grads = sum(i.bytes for i in down_grads)
    pending = _parallel_branch_gradient(acts, prod, residual_bytes)
    # under autocast down_proj's node also released its saved bf16 weight copy
    held = ends[-1] + 1 - mlp.down_saves_input  # from here on freed by the moment
    freed = sum(i.bytes for i in acts[held:] if not i.name.endswith(copy_name)) + weight_copy
    out = [{"block_gradients": grads, "freed_activations": freed,
            "after_attention": 0, "work": residual_bytes + pending + (1 + mlp.act_grads) * prod.bytes}]
    if weight_copy and down_grads:  # a frozen weight's copy has no cast node (it requires no grad)
        # autocast: down_proj's MmBackward0 (AddmmBackward0) made a bf16 weight gradient (the copy's size), its
        # input gradient and, with a bias, the bias's bf16 gradient (``sum_to`` in the engine's
        # ``validate_outputs``), then released its saved copy and input (the product); then the copy's cast
        weight = next((i for i in down_grads if i.shape is not None and len(i.shape) == 2), None)
        # (flat-sharded gradients have no weight shape: the copy's bytes alone, as before the bias was split off)
        new, work = (_cast_weight_moment([i for i in acts if f".mlp.{down}." in i.name], down_grads, weight,
                                         bias_first=mlp.bias_first)
                     if weight is not None else (grads, weight_copy))
        out.append({"block_gradients": new, "new_gradients": new,
                    "freed_activations": sum(i.bytes for i in acts[ends[-1]:]) + weight_copy, "after_attention": 0,
                    "work": residual_bytes + pending + work + prod.bytes})
        if mlp.down_node_end and not pending:
            # AddmmBackward0 (derivatives.yaml ``addmm``) has made the input gradient (the product's size) and the
            # bf16 weight gradient (the copy's size); the engine cast the fp32 residual gradient to the bf16 output's
            # dtype before the node ran (``validate_outputs``, torch/csrc/autograd/engine.cpp); the saved product
            # and weight copy are released only after the node returns, and no fp32 gradient of the block exists
            low = residual_bytes * dtype_bytes(prod.dtype) // dtype_bytes(acts[-1].dtype)
            out.append({"block_gradients": 0, "new_gradients": 0,
                        "freed_activations": sum(i.bytes for i in acts[ends[-1] + 1:] if not i.name.endswith(copy_name)),
                        "after_attention": 0, "work": residual_bytes + low + prod.bytes + weight_copy})
    elif not any(i.name.endswith("_cast") for i in acts if ".mlp." in i.name):
        # The end of the down projection's backward, one dtype. GPT-2's Conv1D (``torch.addmm(bias, x,
        # weight)``): ``AddmmBackward0`` (derivatives.yaml ``addmm``: ``mat1``'s gradient ``grad @ weight.T``,
        # ``mat2``'s ``x.T @ grad``, then ``self``'s ``grad`` reduced to the bias's shape by ``sum_to`` in the
        # engine's ``validate_outputs``, torch/csrc/autograd/engine.cpp); a Llama ``nn.Linear`` without bias:
        # ``MmBackward0``, the same two products. Its saved input (the product) is still held; its output
        # gradient (the residual gradient, and GPT-2's dropout's backward output) too. The new weight (and
        # bias) gradients are ``new_gradients``: the .grad on a first micro-batch, beside it after, which
        # makes this the larger moment when the weight outgrows the product (H > B·S).
        dropout = any(i.name.split(".mlp.", 1)[-1] in tail for i in acts[ends[-1] + 1:])
        made = grads  # the bias's sum_to runs after the node in a checkpointed block (_up_projection_end)
        if checkpointed and mlp.down_node_end:
            made = sum(i.bytes for i in down_grads if i.shape is not None and len(i.shape) == 2) or grads
        out.append({"block_gradients": made, "new_gradients": made,
                    "freed_activations": sum(i.bytes for i in acts[ends[-1] + 1:]), "after_attention": 0,
                    "work": residual_bytes * (1 + dropout) + prod.bytes})
    if checkpointed and not any("/cp" in d for i in acts for d in i.dims):
        # the recomputation stops at the down projection's saved tensor (estimate/recompute_stop.py; under TP
        # on the rank's tensors, --sp's gathered ones too)
        stop = recompute_stop_moment(block, acts, unsaved, down=down, start=start, last=ends[-1],
                                     residual_bytes=residual_bytes, tail=tail)
        out += [stop] if stop else []
    return out + _up_projection_end(block, acts, start, mlp, prod, grads, residual_bytes, pending,
                                    checkpointed=checkpointed)


def _up_projection_end(block: list[MemoryItem], acts: list[MemoryItem], start: int, mlp: MlpNodes,
                       prod: MemoryItem, down_grads: int, residual_bytes: int, pending: int, *,
                       checkpointed: bool) -> list[dict[str, int]]:
    """The end of the one up projection's backward (``AddmmBackward0``; GPT-NeoX's ``dense_h_to_4h``), the
    MLP's last node: every saved tensor of the MLP from ``start`` on was freed but the projection's input
    (the norm's output, released after the node), the MLP's weight gradients exist; alive beside the
    residual gradient (and a parallel block's waiting branch gradient, ``pending``): the activation
    node's output (the projection's output gradient, B·S·F) and the input gradient (B·S·H). The bias's
    ``sum_to`` (the engine's ``validate_outputs``) runs after the node: before that release in eager, after
    it when checkpointed (the recomputed input's one reference is the node's unpacked local:
    torch/utils/checkpoint.py ``_checkpoint_hook`` ``unpack_hook`` drops the frame's handle), so a
    checkpointed block tops before its bias gradient exists. Under autocast the node released its bf16
    input and weight copies too and freed its output gradient; the top is the weight copy's cast
    (:func:`_cast_weight_moment`), beside the norm output's fp32 gradient (the input copy's
    ToCopyBackward0: the residual stream's shape and dtype)."""
    up = [i for i in block if i.category is Category.GRADIENT and f".mlp.{mlp.up}." in i.name]
    weight = next((i for i in up if i.shape is not None and len(i.shape) == 2), None)
    if weight is None or not prod.shape or weight.shape[0] != prod.shape[-1]:
        return []
    freed = sum(i.bytes for i in acts[start:])
    casts = [i for i in acts[:start] if f".mlp.{mlp.up}." in i.name and i.name.endswith("_cast")]
    if casts:
        new, work = _cast_weight_moment(casts, up, weight)
        return [{"block_gradients": down_grads + new, "accum_new_gradients": new,
                 "freed_activations": freed + sum(i.bytes for i in casts), "after_attention": 0,
                 "work": 2 * residual_bytes + pending + work}]
    new = weight.bytes if checkpointed else sum(i.bytes for i in up)
    return [{"block_gradients": down_grads + new, "accum_new_gradients": new, "freed_activations": freed,
             "after_attention": 0,
             "work": residual_bytes + pending + prod.bytes + prod.bytes * weight.shape[1] // weight.shape[0]}]


def _parallel_branch_gradient(acts: list[MemoryItem], prod: MemoryItem, residual_bytes: int) -> int:
    """The attention branch's output gradient waiting while the MLP's nodes run, in a parallel-residual
    block under autocast (GPT-NeoX's ``use_parallel_residual``: ``mlp_output + attn_output + hidden_states``,
    the two bf16 branch outputs summed first): the engine casts the fp32 residual gradient to the bf16
    sum's dtype (``validate_outputs``, torch/csrc/autograd/engine.cpp) and ``AddBackward0`` hands that one
    tensor to both branches, so it waits in the attention's input buffer. In one dtype the branches get
    the residual gradient itself (nothing new); a sequential block saves its ``residual_attn``."""
    children = {_child(i.name) for i in acts}
    out = next((i for i in acts if _child(i.name) == "residual_mlp"), None)
    if out is None or "residual_attn" in children or not children & {"attention", "self_attn", "attn"} \
            or out.dtype == prod.dtype:
        return 0
    return residual_bytes * dtype_bytes(prod.dtype) // dtype_bytes(out.dtype)


def _residual(child: str) -> bool:
    """A residual add's output kept at the block's level (hf rules: ``residual_*``; traced: ``add_N``)."""
    return re.fullmatch(r"residual.*|add(_\d+)?", child) is not None


def llama_norm_indices(acts: list[MemoryItem]) -> list[int]:
    """Indices of each Llama-style RMSNorm's ``x_fp32`` (its four saved tensors in a row)."""
    out = []
    for at in range(len(acts) - len(_NORM) + 1):
        module = acts[at].name.rpartition(".")[0]
        if any([i.name for i in acts[at:at + len(_NORM)]] == [f"{module}.{n}" for n in names]
               for names in (_NORM, _NORM_TRACED)):
            out.append(at)
    return out


def _child(name: str) -> str | None:
    """The block's direct child an item belongs to (``mlp`` for ``model.layers.3.mlp.up_proj.out``)."""
    parts = split_block(name)
    return parts[2].split(".", 1)[0] if parts else None


def _last_block(items: "Inventory | list[MemoryItem]") -> int:
    """The highest block index among ``items`` (a repeat's copies included); -1 without blocks."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    return max([li for li in (layer_of(i.name) for i in inv.base) if li is not None]
               + [d for r in inv.repeats for d in r.dsts], default=-1)


def block_items(items: "Inventory | list[MemoryItem]", last: int) -> list[MemoryItem]:
    """Block ``last``'s own items in inventory order: its base items, or the template of the repeat
    that copies onto it (names inside the block are the same)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    own = [i for i in inv.base if layer_of(i.name) == last]
    # a copy's own base items are what the template lacks, the block's output kept by what follows it (the last
    # block's, by the final norm), made last: after the template's (the norm moments read the order; a last block
    # that copies block 1's template, --recompute every-k at L=4, k=2, freed 49,152 B too little, fp32 B2 S96)
    return [i for r in inv.repeats if last in r.dsts for i in r.items if layer_of(i.name) == r.src] + own


def final_norm_moment(items: "Inventory | list[MemoryItem]", *, head_act: int, loss_scalars: int) -> tuple[int, int] | None:
    """The final Llama-style RMSNorm's backward, after the head's: (the head activations still alive, the
    node's bytes). Its fp32 input (a 16-bit model's ``x_fp32`` copy, kept in the head; an fp32 or autocast
    one is the last block's output, kept in the block) and ``FP32_NORM_TRANSIENTS`` fp32 x-sized
    temporaries beside the loss and its seed; no residual gradient yet (this node makes it). None when
    the final norm is not a Llama-style RMSNorm (``model.norm.rsqrt`` and ``normed``/``x_fp32``)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    norm = {i.name.rpartition(".")[2]: i for i in inv.base
            if i.name.startswith("model.norm.") and i.category is Category.ACTIVATION}
    if "rsqrt" not in norm or set(norm) & set(OTHER_NORM_KINDS):
        return None
    # the hf rules' names, or --profile traced's (named by the op that made each: _to_copy is the fp32 copy)
    copy = norm.get("x_fp32") or next((i for i in (norm.get("_to_copy"),) if i is not None and i.dtype == "float32"), None)
    x = copy or norm.get("normed") or norm.get("mul")
    # --profile traced names a cut dim by its divisor ("S/4"), the hf rules by its axis ("S/tp")
    if x is None or x.dtype != "float32" or any("/tp" in d or "/cp" in d or d.startswith("S/") for d in x.dims):
        return None  # checked on one device (and data parallel), not on a TP/CP-cut norm
    return (copy.bytes if copy is not None else 0), FP32_NORM_TRANSIENTS * x.bytes + loss_scalars
