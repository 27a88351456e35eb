"""BERT's forward moments inside its last block, the ``forward`` phase where one is larger than the end of the
forward (the loss): the attention core's output cast, and the block's last LayerNorm.

**The attention core** (``--attention sdpa`` on CPU with attention dropout: PyTorch's math kernel,
``aten/src/ATen/native/transformers/attention.cpp`` ``_scaled_dot_product_attention_math``). A 16-bit query, key
and value are upcast (``query_.to(at::kFloat)``, ...); the kernel returns ``matmul(attn, value_acc).to(origin_dtype)``
and ``attn.to(origin_dtype)``, so when that last cast is made, besides every tensor saved so far (the scaled q and
k, the softmax, the dropout mask and output, value_acc: the block's ``attention.self.*`` items but ``attn_out``):

* the q, k, v projections' outputs (``BertSelfAttention.forward``'s locals), unsaved: the upcast copies are what the
  matmuls save; in fp32 ``.to(kFloat)`` returns the tensor itself, and v is saved as ``value_acc``;
* the fp32 ``query_acc`` and ``key_acc``, the kernel's locals (only their scaled copies are saved);
* the attention weights' 16-bit copy (the kernel's second output, dropped by ``scaled_dot_product_attention``);
* the fp32 ``bmm`` output and its 16-bit cast (in fp32 the one output).

**The last LayerNorm** (``BertOutput.forward``: ``LayerNorm(dropout(dense(h)) + input_tensor)``): its output is
made while the dropout's output (``add`` keeps no input: ``torch/csrc/autograd/FunctionsManual`` / derivatives.yaml
``add.Tensor``) is still bound, beside every saved tensor of the body and before any of the head's.

Under autocast, at both moments, tensors the linears save only as bf16 casts are alive in fp32: the embeddings'
output (``BertModel.forward``'s ``embedding_output``, bound until the encoder returns), the last block's input
(its own frame's argument), at the LayerNorm the block's attention output (``BertLayer.forward``'s
``attention_output``, LayerNorm runs in fp32 under autocast); and autocast's cached bias copies of every linear
run so far (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: ``estimate/forward_held.py``).

Where checked: ``tests/estimate/test_encoder_forward.py`` (a tiny BERT's mlm, seq-cls and token-cls heads in fp32,
bf16 and amp-bf16, B1/B2 x S32/S64: the forward phase == a CPU fake-tensor trace's forward top). Read for BERT
(``model_type`` bert: post-LN encoder blocks) under the hf profile on one device, eager, no recompute, no
fine-tuning, no offload; the core's moment for the math kernel only. ``phases`` unchanged otherwise.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.layer_stats import layer_stats
from trainmem.estimate.phase import Phase
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, dtype_bytes
from trainmem.names import layer_of
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["with_encoder_forward", "core_transients", "norm_transients", "autocast_held"]

#: the forward phase's parts that are alive at every forward moment (the model states, the caller's ids)
_ALWAYS = ("parameters", "master_weights", "optimizer_states", "buffers", "gradients", "caller_ids")
#: the last block's saved tensors made after its attention core: its output projection's input and what follows
_AFTER_CORE = ".attention.self.attn_out"


def core_transients(*, B: int, S: int, H: int, A: int, act: str) -> dict[str, int]:
    """Unsaved tensors alive at the math kernel's output cast (the module docstring), in bytes. ``act``: the
    projections' output dtype. With B > 1 and A > 1 the (B, A, S, hd) operands, transposes of (B, S, A, hd)
    projections, cannot fold B and A into bmm's batch as views (``aten/src/ATen/native/LinearAlgebra.cpp``
    ``_matmul_impl``: ``expand(...).reshape(...)``), so matmul saves contiguous copies of the scaled q and k and of
    value_acc; the scaled q (the kernel's local ``q``) and value_acc are then unsaved (the scaled k is freed by then)."""
    a, up, copies = dtype_bytes(act), act != "float32", B > 1 and A > 1
    bsh = B * S * H
    return {"qkv_outputs": int(bsh * a * (3 if up or copies else 2)),  # fp32, folded: v is value_acc, saved
            "qk_upcast": bsh * 4 * 2 if up else 0,
            "fold_copies_inputs": bsh * 4 * (1 + up) if copies else 0,  # the scaled q; a 16-bit v's value_acc
            "attn_weights_cast": int(B * A * S * S * a) if up else 0,
            "core_output": bsh * 4 + (int(bsh * a) if up else 0)}


def norm_transients(*, B: int, S: int, H: int, act: str, compute: str) -> dict[str, int]:
    """Unsaved tensors alive when the last LayerNorm's output is made: the dropout's output (``act``: the dense
    projection's dtype) and the norm's output (``compute``: LayerNorm's dtype, fp32 under autocast)."""
    bsh = B * S * H
    return {"dropout_output": int(bsh * dtype_bytes(act)), "norm_output": int(bsh * dtype_bytes(compute))}


def autocast_held(*, B: int, S: int, H: int, layers: int, at_norm: bool) -> int:
    """Autocast's fp32 tensors the linears save only as casts: the embeddings' output, the last block's input (the
    same tensor with one block) and, at the LayerNorm, the block's attention output."""
    return B * S * H * 4 * (1 + (layers > 1) + at_norm)


def _bias_cache(states: Inventory, last: int, *, at_norm: bool, low: str) -> int:
    """Autocast's cached 16-bit copies of the trainable linear biases run so far: every block's before ``last``,
    and in ``last`` its q, k, v projections' (the core) or all (the LayerNorm)."""
    grads = {i.name.removesuffix(".grad") for i in states if i.category is Category.GRADIENT}
    n = 0
    for i in states:
        li = layer_of(i.name)
        if i.category is not Category.PARAMETER or i.name not in grads or not i.name.endswith(".bias") or li is None \
                or "LayerNorm" in i.name or li > last:
            continue
        if li < last or at_norm or ".attention.self." in i.name:
            n += i.bytes // dtype_bytes(i.dtype)
    return int(n * dtype_bytes(low))


def modelled(model: ModelSpec, impl: ImplSpec, finetune=None) -> bool:
    return (family_of(model).rules.forward == "bert" and model.arch == "encoder" and impl.profile == "hf" and impl.framework == "hf"
            and not impl.compile and impl.recompute == "none" and finetune is None)


def with_encoder_forward(phases: list[Phase], items: Inventory, model: ModelSpec, step: StepSpec, impl: ImplSpec,
                         kernel: str, finetune=None) -> list[Phase]:
    """``phases`` whose ``forward`` is the largest of the end of the forward and the last block's two moments (the
    module docstring). ``kernel``: the attention kernel (``estimate/attention.py`` ``kernel_for``)."""
    fwd = next((p for p in phases if p.name == "forward"), None)
    if fwd is None or not modelled(model, impl, finetune):
        return phases
    d = step.dtypes
    act = d.activation if d.autocast else d.compute
    B, S, H, L, last = step.batch, step.seq, model.hidden_size, model.num_layers, model.num_layers - 1
    st = layer_stats(items, ())
    body = st.by_cat.get(Category.ACTIVATION, 0) - st.head_act
    base = {k: v for k, v in fwd.parts.items() if k in _ALWAYS}
    found = []
    own = block_items(items, last)
    norm = {**base, "activations": body, **norm_transients(B=B, S=S, H=H, act=act, compute=d.compute)}
    if any(i.name.endswith(".output.LayerNorm.out") and i.category is Category.ACTIVATION for i in own):
        norm.pop("norm_output")  # saved by what follows (the pooler's first-token view, the MLM transform): counted
    if d.autocast:
        norm["autocast_fp32_held"] = autocast_held(B=B, S=S, H=H, layers=L, at_norm=True)
        norm["autocast_bias_cache"] = _bias_cache(items, last, at_norm=True, low=d.activation)
    found.append((norm, "at the last block's LayerNorm output: every saved tensor of the body, the dropout's and "
                        "the norm's outputs (estimate/encoder_forward.py)"))
    if kernel == "math":
        cut = next((k for k, i in enumerate(own) if i.name.endswith(_AFTER_CORE)), len(own))
        later = sum(i.bytes for i in own[cut:] if i.category is Category.ACTIVATION)
        core = {**base, "activations": body - later,
                **core_transients(B=B, S=S, H=H, A=model.num_heads, act=act)}
        if d.autocast:
            core["autocast_fp32_held"] = autocast_held(B=B, S=S, H=H, layers=L, at_norm=False)
            core["autocast_bias_cache"] = _bias_cache(items, last, at_norm=False, low=d.activation)
        found.append((core, "at the last block's math attention output cast: the tensors saved so far, the q/k/v "
                            "projections, the fp32 upcasts, the weights' and output's casts (estimate/encoder_forward.py)"))
    parts, note = max(found, key=lambda f: sum(f[0].values()))
    if sum(parts.values()) <= fwd.bytes:
        return phases
    parts = {k: v for k, v in parts.items() if v}
    return [Phase("forward", sum(parts.values()), parts, note) if p is fwd else p for p in phases]
