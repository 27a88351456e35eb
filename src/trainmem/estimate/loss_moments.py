"""The loss's and the head's moments of a step (estimate/peak.py): the end of forward inside the loss, the
loss's backward, a framework loss's head moments, and an encoder-decoder's ``stack_end`` (``--profile traced``).

* plain cross-entropy (``ce``): the logits and their fp32 copy the output object holds at the end of forward;
  in the loss backward the gradients of the log-softmax output and of the fp32 logits (two B·S·V·4 tensors),
  or a compiled ``ForCausalLMLoss``'s recomputed log-softmax (estimate/compiled_ce_loss.py);
* torchtune's / LitGPT's chunked losses: their chunks' moments (estimate/losses.py,
  estimate/compiled_chunk_loss.py);
* any other loss (chunked or fused CE, or none on a pipeline stage before the last): the end of forward.
"""

from __future__ import annotations

from trainmem.estimate.compiled_ce_loss import compiled_ce_backward, graph_tangents
from trainmem.estimate.losses import FRAMEWORK_LOSSES, framework_loss_phases, lora_head_input
from trainmem.estimate.phase_inputs import PhaseInputs
from trainmem.estimate.phase_parts import StepSums, Timeline, head_weight_bytes
from trainmem.inventory import dtype_bytes

__all__ = ["loss_phases", "stack_end_phase"]


def loss_phases(tl: Timeline, items, inp: PhaseInputs, s: StepSums) -> None:
    """Add ``forward`` and ``backward_start`` (and a framework loss's ``head_backward``) to ``tl``."""
    st, A, g_acc, loss = s.st, s.A, s.g_acc, inp.loss
    if loss == "ce":
        lb = dtype_bytes(inp.loss_dtype)
        logits = int(s.BSV * dtype_bytes(inp.logits_dtype))
        upcast = int(s.BSV * lb) if inp.loss_dtype != inp.logits_dtype else 0
        # inside the cross-entropy the load-balancing loss (after it) is not made yet; the output holds every MoE
        # block's router logits for it (transformers' OutputRecorder), the bytes of its kept softmax each
        tl.add("forward", {"gradients": g_acc, "activations": A - st.aux_saved, "logits": logits + upcast,
                           "router_logits": sum(s.router_grads.values())},
               "end of forward: saved activations + logits (and their upcast copy) held by the output")
        # log_softmax's backward runs after NllLossBackward0 released its saved target and total weight
        # (torch/csrc/autograd/engine.cpp, Node::release_variables after call_function); the seed
        # gradient of the loss (torch/autograd/__init__.py _make_grads: ones_like) is alive
        # compiled, the recomputed fp32 log-softmax's first step, its logits input freed (estimate/compiled_ce_loss.py)
        held = 0 if inp.rank.logits_held else logits
        ce = (held, compiled_ce_backward(s.BSV, held, inp.tokens)) if st.compiled_ce else (0, int(2 * s.BSV * lb))
        tl.add("backward_start", {"gradients": g_acc, "activations": A - st.nll_saved - st.aux_saved - ce[0],
                                  "logits_grad": ce[1], "loss_seed": lb if st.nll_saved else 0,
                                  # one graph: its outputs' zero-filled tangents (estimate/compiled_ce_loss.py)
                                  "zero_tangents": graph_tangents(items, logits) if st.compiled_ce and (
                                      inp.compiled.block_math or {}).get("one_graph") else 0,
                                  "router_logits_grad": sum(s.router_grads.values())},
               f"loss backward: activations + grad of the log-softmax output and of the logits (2·B·S·V·{lb:g})")
    elif loss in FRAMEWORK_LOSSES:  # torchtune's / LitGPT's chunked CE (estimate/losses.py)
        from trainmem.estimate.compiled_chunk_loss import compiled_chunk_phases
        row = inp.residual_bytes // inp.tokens
        fl = (compiled_chunk_phases if inp.compiled.loss else framework_loss_phases)(
            loss, B=inp.batch, S=inp.seq, V=inp.vocab, logits_dtype=inp.logits_dtype, hidden_row_bytes=row,
            head_weight_grad=head_weight_bytes(items), lora_head_input=lora_head_input(items, inp.batch, inp.seq, row))
        if fl.held:  # LitGPT's loop keeps its logits bound in every phase
            tl.persistent["logits_held"] = fl.held
        # inside the last chunk the loss value (total / count) is not made yet
        fwd = {"gradients": g_acc, "activations": A - st.loss_value, **fl.forward}
        head = {"gradients": g_acc, "activations": A - st.loss_act, **(fl.head_forward or {})}
        if fl.head_forward and sum(head.values()) > sum(fwd.values()):
            tl.add("forward", head, "inside the last LoRA head chunk: its frozen and adapter outputs and their sum, "
                                    "the earlier chunks' logits, the loop's previous logits (estimate/losses.py)")
        else:
            tl.add("forward", fwd, f"end of forward, inside the last chunk of {loss}: saved activations + the "
                                   "chunks' logits")
        tl.add("backward_start", {"gradients": g_acc, "activations": A, **fl.backward_start},
               f"{loss} backward, chunk by chunk: one chunk's log-softmax gradients + the logit gradients so far")
        if fl.head_backward:
            tl.add("head_backward", {"gradients": g_acc, "activations": A - st.loss_act, **fl.head_backward},
                   "the head's chunk matmuls backward: two chunks' weight gradients and their sum, the logit "
                   "gradients still to run")
    else:
        tl.add("forward", {"gradients": g_acc, "activations": A},
               "end of forward" + (" (chunked loss)" if loss != "none" else ""))


def stack_end_phase(tl: Timeline, inp: PhaseInputs, s: StepSums) -> None:
    """Before the head: T5Stack.forward's position biases, embeddings and cache, its last outputs (``--profile
    traced``, an encoder-decoder; nothing otherwise)."""
    if inp.stack_held:
        tl.add("stack_end", {"gradients": s.g_acc, "activations": s.A - s.st.head_act, "stack_locals": inp.stack_held},
               "end of the decoder stack: every kept tensor but the head's, and the stack's locals "
               "(position biases, input embeddings, KV cache, the final norm's and dropout's outputs)")
