"""One BERT layer's backward, node by node, as allocations and frees in bytes (pure arithmetic; the phases are
estimate/encoder_backward.py's). Each node makes its outputs, then releases its saved tensors
(``torch/csrc/autograd/engine.cpp`` ``Node::release_variables``) and its input gradients; per node (derivatives.yaml):

* a LayerNorm (``native_layer_norm_backward``): its input gradient and the weight's and bias's; it frees its input
  (the residual sum), mean and rstd and the output gradient;
* a dropout (``native_dropout_backward``: ``grad * mask * scale``): one tensor, the mask freed;
* a linear (``AddmmBackward0``: ``mm_mat1_backward``, ``mm_mat2_backward``, the bias's ``sum``): the input's, weight's
  and bias's gradients, then its incoming gradient and saved input freed; its input gradient dies at its one
  reader's node (GELU's, the attention core's first);
* GELU (``gelu_backward``): one tensor of the intermediate size, its saved input freed;
* the residual sums: autograd adds the two gradients reaching one input (``input_buffer.cpp``), then frees both;
* the attention core, PyTorch's math SDPA (``attention.cpp`` ``_scaled_dot_product_attention_math``, CPU with
  attention dropout): 16-bit q, k, v run in fp32, so the output gradient is upcast (``ToCopyBackward0``); where B
  and A cannot fold into bmm's batch as a view (B > 1, A > 1: ``_matmul_impl``'s reshape) a contiguous copy of the
  gradient is made. P·V's ``BmmBackward0`` makes the value's and the weights' gradients, then frees value_acc and the
  dropout's output; the dropout's and the softmax's nodes follow, Q·Kᵀ's makes the scaled q's and k's gradients, the
  scale ``mul`` nodes theirs, and in 16 bits the casts back. Each projection's input gradient is a (B, S, A, hd)
  transpose, copied to be flattened but for the key's at B = 1 (its (A, hd) axes merge: a strided view).

Under autocast (``aten/src/ATen/autocast_mode.cpp``) the linears run in 16 bits on casts of their fp32 weights and,
where it is fp32 (a LayerNorm's output), of their input, which they save; the LayerNorms and the residual stream run
in fp32. A linear's gradients are 16-bit; after its node the casts' ``ToCopyBackward0`` nodes run in argument order
(the input's fp32 gradient, where it was cast; the weight's, then the bias's fp32 gradients, each 16-bit one freed).
The residual add of a 16-bit branch to the fp32 stream casts the fp32 gradient to 16 bits for the branch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockDims", "block_events", "peak_of"]


@dataclass(frozen=True, kw_only=True)
class BlockDims:
    """One BERT layer's sizes: tokens ``B``·``S``, ``H`` hidden, ``F`` intermediate, ``A`` heads; dtype bytes of
    ``act`` the linears' outputs, ``param`` the parameters (and gradients), ``norm`` the LayerNorms and the
    residual stream (``act`` but under autocast, fp32 there)."""

    B: int
    S: int
    H: int
    F: int
    A: int
    act: float
    param: float
    norm: float = 0  # 0: act

    @property
    def autocast(self) -> bool:
        return bool(self.norm) and self.norm != self.act


def block_events(saved: dict[str, int], d: BlockDims, *, input_name: str) -> list[tuple[str, str, int]]:
    """One BERT layer's backward from its output LayerNorm's gradient on, as (kind, label, bytes) in order: kind
    ``work`` (a transient gradient, + made / − freed), ``grad`` (a parameter's gradient made) or ``saved`` (a
    saved tensor freed, bytes > 0). ``saved``: the layer's saved tensors' bytes by name under the layer
    (``attention.self.q``...); ``input_name``: the saved layer input's key (freed at the query projection)."""
    B, S, H, F, A, a, p = d.B, d.S, d.H, d.F, d.A, d.act, d.param
    amp, n = d.autocast, d.norm or a
    up, fold = a != 4, B > 1 and A > 1
    bsh, bsf, bass = int(B * S * H * a), int(B * S * F * a), B * A * S * S * 4
    rsh = int(B * S * H * n)  # a residual-stream gradient
    bhd4 = B * S * H * 4  # a (B, A, S, hd) fp32 tensor of the math kernel
    ev: list[tuple[str, str, int]] = []

    def work(label, nb):
        ev.append(("work", label, int(nb)))

    def free(name):
        ev.append(("saved", name, saved.get(name, 0)))

    def norm(prefix, g_out):  # native_layer_norm_backward, then its saved input, mean and rstd freed
        work(f"{prefix}.LayerNorm input grad", rsh)
        ev.append(("grad", f"{prefix}.LayerNorm weight, bias", int(2 * H * p)))
        work("output grad freed", -g_out)
        for k in (".residual", ".LayerNorm.mean", ".LayerNorm.rstd"):
            free(prefix + k)

    def dropout(prefix):  # the residual add's branch gradient (cast to 16 bits under autocast), the dropout's node
        if amp:
            work(f"{prefix}.dropout grad cast", bsh)
        work(f"{prefix}.dropout grad", bsh)
        if amp:
            work(f"{prefix}.dropout grad cast freed", -bsh)
        free(f"{prefix}.dropout.mask")

    def linear(x, n_in, n_out, incoming, saved_input, *, residual_sum=False):
        """``x``'s node: its input gradient (n_in features), weight and bias gradients; ``incoming``: its incoming
        gradient's bytes, freed; ``saved_input``: its saved input's key. ``residual_sum``: its input, read from the
        residual stream (cast under autocast), gets a gradient added to the waiting one (the LayerNorm's or the
        previous projection's), both then freed."""
        w, gx = (n_out * n_in + n_out), int(B * S * n_in * a)
        work(f"{x} input grad", gx)
        if amp:
            work(f"{x} weight, bias 16-bit grads", w * a)
        else:
            ev.append(("grad", f"{x} weight, bias", int(w * p)))
        work(f"{x} incoming grad freed", -incoming)
        if amp and residual_sum:  # autocast: the linear saved its own cast of the fp32 stream
            free(f"{x}.input_cast")
        elif saved_input is not None:
            free(saved_input)
        if amp:
            free(f"{x}.weight_cast")
        if residual_sum:
            if amp:  # the input cast's ToCopyBackward0
                work(f"{x} input fp32 grad", rsh)
                work(f"{x} input 16-bit grad freed", -gx)
            work("residual sum", rsh)
            work("the sum's addends freed", -rsh - (rsh if amp else gx))
        if amp:
            ev.append(("grad", f"{x} weight, bias fp32", int(w * p)))
            work(f"{x} 16-bit grads freed", -w * a)
        return gx

    work("block output grad", rsh)
    norm("output", rsh)
    dropout("output")
    gx2 = linear("output.dense", F, H, bsh, "intermediate.intermediate_act_fn.out")
    work("gelu grad", bsf)
    work("output.dense input grad freed", -gx2)
    free("intermediate.dense.out")
    linear("intermediate.dense", H, F, bsf, "attention.output.LayerNorm.out", residual_sum=True)
    norm("attention.output", rsh)
    dropout("attention.output")
    gx3 = linear("attention.output.dense", H, H, bsh, "attention.self.attn_out")
    # P·V's backward on the output gradient: its fp32 upcast, its fold copy (the upcast then freed)
    if up:
        work("the output grad's fp32 upcast", bhd4)
        work("attention.output.dense input grad freed", -gx3)
    if fold:
        work("the output grad's fold copy", bhd4)
        work("the upcast freed" if up else "attention.output.dense input grad freed", -bhd4 if up else -gx3)
    work("value_acc grad", bhd4)
    work("attention weights grad", bass)
    work("the output grad's copy freed" if up or fold else "attention.output.dense input grad freed",
         -bhd4 if up or fold else -gx3)
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
        # the block input, saved once for the three (16 bits: each its own cast), is freed by the last to run
        linear(f"attention.self.{x}", H, H, bsh if copied else g, input_name if x == "query" or amp else None,
               residual_sum=True)
    return ev


def peak_of(events: list[tuple[str, str, int]]) -> tuple[int, int, int, int, str]:
    """The largest running sum of ``events``: (work, gradients made, saved freed, total, label) at it."""
    work = made = freed = 0
    best = (0, 0, 0, 0, "")
    for kind, label, nb in events:
        if kind == "work":
            work += nb
        elif kind == "grad":
            made += nb
        else:
            freed += nb
        if work + made - freed > best[3]:
            best = (work, made, freed, work + made - freed, label)
    return best
