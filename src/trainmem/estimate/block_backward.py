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
"""

from __future__ import annotations

import re

from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.names import layer_of, split_block

# the block moments (the gated MLP's product, each RMSNorm), and the norm layout grad_accum.py reads
__all__ = ["norm_backward_parts", "final_norm_moment", "llama_norm_indices", "block_items", "FP32_NORM_TRANSIENTS", "OTHER_NORM_KINDS"]

_NORM = ("x_fp32", "rsqrt", "normed_cast", "out")  # a Llama-style RMSNorm's saved tensors, in order
_NORM_TRACED = ("_to_copy", "rsqrt", "_to_copy_1", "mul")  # the same, named by --profile traced's ops
#: saved by the other RMSNorm variants (Gemma's 1 + w, OLMo-2's and gpt-oss' cast-last): not modelled here
OTHER_NORM_KINDS = ("one_plus_w", "out_fp32")
_MLP = ("gate_proj.out", "act_fn.out", "up_proj.out", "act_mul_up")  # a Llama MLP's saved tensors
#: the same four as ``--profile traced`` names them (estimate/traced: by the op that made each)
_MLP_TRACED = ("gate_proj.mm", "act_fn.silu", "up_proj.mm", "mul")
#: (the MLP's saved tensors ending with its last product, its down projection, what may follow inside the MLP)
_MLPS = ((_MLP, "down_proj", ()), (_MLP_TRACED, "down_proj", ()),
         (("c_fc.out", "act.tanh", "act.one_plus_tanh", "act.half_x", "act.out"), "c_proj", ("dropout.mask",)))
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
    acts = [i for i in (block_items(recomputed, last) if recomputed is not None else block)
            if i.category is Category.ACTIVATION]
    if any(i.name.rpartition(".")[2] in OTHER_NORM_KINDS or ".experts." in i.name for i in acts):
        return []
    out = _gated_mlp(block, acts, residual_bytes) + _input_projections(block, acts, residual_bytes,
                                                                       checkpointed=recomputed is not None)
    for at in llama_norm_indices(acts):
        after = acts[at:]
        children = {_child(i.name) for i in after}
        out.append({"block_gradients": sum(i.bytes for i in block
                                           if i.category is Category.GRADIENT and _child(i.name) in children),
                    "freed_activations": sum(i.bytes for i in after[1:]),
                    # the attention ran its backward: a first block's rope freed the shared cos/sin
                    "after_attention": int(any(c not in (_child(acts[at].name), "mlp") for c in children)),
                    "work": residual_bytes + FP32_NORM_TRANSIENTS * acts[at].bytes})
    return out


def _input_projections(block: list[MemoryItem], acts: list[MemoryItem], residual_bytes: int, *,
                       checkpointed: bool = False) -> list[dict[str, int]]:
    """The end of the attention's first input projection's backward (``q_proj``: forward runs q, k, v, so
    its ``MmBackward0`` runs last; derivatives.yaml ``mm``: ``grad @ weight`` and ``x.T @ grad``), in one
    dtype. Every block gradient but the input norm's exists (q_proj's is new: ``accum_new_gradients``
    beside its .grad from a second micro-batch); of the block's activations only the input norm's remain
    (the attention's backward ran: a first block's rope freed the shared cos/sin, unless the block is
    checkpointed: the non-reentrant checkpoint's frame keeps its inputs until the norm's saved tensors are
    unpacked, torch/utils/checkpoint.py ``_checkpoint_hook``); alive besides: the
    residual gradient, the norm output's gradient summed so far from v and k (``InputBuffer::accumulate``,
    torch/csrc/autograd/input_buffer.cpp), q's output gradient made contiguous for the view's backward
    (B·S·A·hd) and q_proj's input gradient (B·S·H). In fp32 this is the first block's top when the weights
    outweigh the activations (no RMSNorm casts: ``llama_norm_indices`` finds no fp32 moment)."""
    grads = [i for i in block if i.category is Category.GRADIENT]
    q = [i for i in grads if ".self_attn.q_proj." in i.name]
    first = next((k for k, i in enumerate(acts) if _child(i.name) == "self_attn"), None)
    if not q or first is None or first == 0 or not all(any(f".self_attn.{p}." in i.name for i in grads)
                                                        for p in ("k_proj", "v_proj")) \
            or any(i.name.endswith("_cast") for i in acts if _child(i.name) == "self_attn"):
        return []
    norm = _child(acts[first - 1].name)  # the input norm, whose saved tensors come right before
    x = acts[first - 1]  # its output: the projections' input (B, S, H)
    weight = next((i for i in q if i.shape is not None and len(i.shape) == 2), None)
    if weight is None or not x.shape or weight.shape[1] != x.shape[-1] or \
            any("/tp" in d or "/cp" in d for i in acts for d in i.dims):
        return []  # checked on one device and data parallel: not with flat (FSDP, ZeRO) or TP/CP-cut tensors
    q_out = x.bytes * weight.shape[0] // weight.shape[1]  # (B, S, A·hd) in the same dtype
    return [{"block_gradients": sum(i.bytes for i in grads if _child(i.name) != norm),
             "accum_new_gradients": sum(i.bytes for i in q),
             "freed_activations": sum(i.bytes for i in acts[first:]), "after_attention": int(not checkpointed),
             "work": residual_bytes + 2 * x.bytes + q_out}]


def _gated_mlp(block: list[MemoryItem], acts: list[MemoryItem], residual_bytes: int) -> list[dict[str, int]]:
    """The moment of an MLP's last product's backward, when the MLP is the block's last child
    (``MulBackward0``: ``grad * other`` and ``grad * self``, two (B, S, F) tensors,
    ``tools/autograd/derivatives.yaml`` ``mul.Tensor``): a Llama MLP's ``act_fn(gate) * up``, or HF
    GPT-2's ``gelu_new`` (``NewGELUActivation.forward``: ``0.5 * x * (1 + tanh(...))``, the product of
    ``half_x`` and ``one_plus_tanh`` last). The down projection's input gradient (B, S, F) and weight
    gradient exist (Conv1D: ``addmm`` backward's ``mm`` for each, and its bias gradient's ``sum``),
    its saved input (the product) was freed, the MLP's dropout mask too, and so was the block output
    a later node kept (``residual_mlp``: the final norm's input)."""
    # a Llama MLP under autocast keeps its linears' bf16 weight and input copies among its tensors: it is
    # matched without them (GPT-2's as it is)
    core = [i for i in acts if not i.name.endswith((".weight_cast", ".input_cast"))]
    for names, down, tail in _MLPS:
        seq = acts if tail else core
        ends = [k for k, i in enumerate(seq) if i.name.endswith(f".mlp.{names[-1]}")]
        if ends and ends[-1] >= len(names) - 1 and \
                [i.name.split(".mlp.", 1)[-1] for i in seq[ends[-1] + 1 - len(names):ends[-1] + 1]] == list(names):
            ends = [acts.index(seq[ends[-1]])]
            break
    else:
        return []
    weight_copy = 0 if tail else sum(i.bytes for i in acts if i.name.endswith(f".mlp.{down}.weight_cast"))
    # after the MLP only its dropout mask and the block's residual adds (``residual_mlp``; traced: ``add``, ``add_1``)
    if any(not (_residual(_child(i.name) or "") or i.name.split(".mlp.", 1)[-1] in tail) for i in acts[ends[-1] + 1:]):
        return []
    prod = acts[ends[-1]]
    grads = sum(i.bytes for i in block if i.category is Category.GRADIENT and f".mlp.{down}." in i.name)
    # under autocast down_proj's node also released its saved bf16 weight copy
    out = [{"block_gradients": grads, "freed_activations": sum(i.bytes for i in acts[ends[-1]:]) + weight_copy,
            "after_attention": 0, "work": residual_bytes + 3 * prod.bytes}]
    if weight_copy:
        # autocast: down_proj's MmBackward0 made a bf16 weight gradient (the copy's size) and its input gradient,
        # then released its saved copy and input (the product); the copy's ToCopyBackward0 casts the weight
        # gradient to the weight's fp32 (new beside .grad from a second micro-batch) while the bf16 one is alive
        out.append({"block_gradients": grads, "new_gradients": grads,
                    "freed_activations": sum(i.bytes for i in acts[ends[-1]:]) + weight_copy, "after_attention": 0,
                    "work": residual_bytes + weight_copy + prod.bytes})
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
        out.append({"block_gradients": grads, "new_gradients": grads,
                    "freed_activations": sum(i.bytes for i in acts[ends[-1] + 1:]), "after_attention": 0,
                    "work": residual_bytes * (1 + dropout) + prod.bytes})
    return out


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


def block_items(items: "Inventory | list[MemoryItem]", last: int) -> list[MemoryItem]:
    """Block ``last``'s own items in inventory order: its base items, or the template of the repeat
    that copies onto it (names inside the block are the same)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    out = [i for i in inv.base if layer_of(i.name) == last]
    for r in inv.repeats:
        if last in r.dsts:
            out += [i for i in r.items if layer_of(i.name) == r.src]
    return out


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
    if x is None or x.dtype != "float32" or any("/tp" in d or "/cp" in d for d in x.dims):
        return None  # checked on one device (and data parallel), not on a TP/CP-cut norm
    return (copy.bytes if copy is not None else 0), FP32_NORM_TRANSIENTS * x.bytes + loss_scalars
