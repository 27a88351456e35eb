"""The frameworks' chunked cross-entropy losses: what each keeps for backward and what is alive
around it (``StepSpec.loss``; the tracer runs the same code paths: :mod:`trainmem.trace.losses`).

``torchtune-chunked-ce`` -- torchtune's ``TransformerDecoder.chunked_output`` +
``CEWithChunkedOutputLoss`` (torchtune/modules/transformer.py, modules/loss/
ce_chunked_output_loss.py; recipes/full_finetune_single_device.py ``_loss_step``). The head runs
once per chunk of ``h.chunk(8, dim=1)`` (each linear keeps a view of h: the one head input).
Per chunk ``c`` (rows r_c = B·len_c):

* kept: ``log_softmax`` of the upcast chunk, fp32 r_c·V·4 (summed over chunks: B·S·V·4, as
  plain CE), the chunk's labels (int64; B·S·8 over all chunks), nll_loss's total weight (fp32, 4
  bytes per chunk) and the token count the mean divides by (int64, 8 bytes);
* transient in forward: the chunk's fp32 upcast (r_c·V·4; none for fp32 logits), alive while its
  log-softmax is made. Every chunk's logits (B·S·V in the compute dtype) are alive until the
  recipe's ``del logits``, so the forward peak is at the last chunk:
  ``logits B·S·V·d + upcast r_last·V·4`` over the kept set (plus, from B=2, the shifted label
  tensor ``hstack`` made, B·S·8: its chunks were copied by ``reshape``);
* backward: autograd runs every chunk's loss backward before any head matmul (higher sequence
  numbers first), newest chunk first. Chunk j's log-softmax backward holds the nll gradient and its
  own output, fp32 2·r_j·V·4, next to the log-softmax outputs of chunks ≤ j and the logit
  gradients (compute dtype) of the chunks after j: ``max_j 8·r_j·V + 4·V·Σ_{i<=j} r_i +
  d·V·Σ_{i>j} r_i`` over the rest, where plain CE holds two whole-logit fp32 tensors.

``litgpt-chunked-ce`` -- LitGPT's ``GPT.forward(lm_head_chunk_size=128)`` + ``chunked_cross_entropy``
(litgpt/model.py, litgpt/utils.py; litgpt/finetune/lora.py). The head runs per 128-token split;
the last chunk drops its final row (a view); cross-entropy runs on the logits as they are (bf16
under ``bf16-true``: no upcast, log-softmax kept in the logits' dtype), ``reduction="none"``:

* kept: ``log_softmax`` d·V per row, B·(S-1) rows; the shifted targets (int64: views of the labels
  input at B=1, B·(S-1)·8 copied by ``reshape`` from B=2), 4 bytes of total weight per chunk and
  the clamped token count (int64, 8 bytes);
* the loop keeps ``logits`` (every chunk, B·S·V·d) bound through backward and the optimizer step:
  held in every phase of the step. In forward, from B=2 the sliced last chunk's rows are copied by
  ``reshape`` (r_last·V·d) and the per-row losses (d per row) are alive until the function returns;
* backward: as above with no upcast, ``max_j 2·r_j·V·d + d·V·Σ_{i<=j} r_i + d·V·Σ_{i>j} r_i``
  (the logits' own gradients replace their log-softmax, row for row).

Both: the head's chunk matmuls run backward after every chunk's loss backward; their weight
gradients are summed out of place (:func:`_head_backward`, phase ``head_backward``).

Where checked: ``tests/estimate/test_framework_loss_rules.py`` (estimate == trace to the byte in the
loss phases, tiny Llama and Qwen2, fp32 and bf16, B=1 and 2; wide heads where ``head_backward`` is
the top) and ``tests/trace/test_trace_framework_losses.py`` (trace == real CPU step; the tracer's
torchtune loss against torchtune's own class).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainmem.estimate.loss_value import loss_value
from trainmem.inventory import dtype_bytes
from trainmem.specs.step import FRAMEWORK_LOSSES, LITGPT_CHUNK, TORCHTUNE_CHUNKS

__all__ = ["FRAMEWORK_LOSSES", "TORCHTUNE_CHUNKS", "LITGPT_CHUNK", "chunk_lengths", "LossPhases",
           "framework_loss_phases", "framework_loss_items", "torchtune_head", "lora_head_input"]


def chunk_lengths(loss: str, S: int) -> list[int]:
    """Sequence positions per chunk: ``torch.chunk(S, 8)`` (ceil(S/8) each, the rest last) for
    torchtune, ``torch.split(S, 128)`` for LitGPT."""
    size = -(-S // TORCHTUNE_CHUNKS) if loss == "torchtune-chunked-ce" else LITGPT_CHUNK
    return [min(size, S - i) for i in range(0, S, size)]


def _rows(loss: str, B: int, S: int) -> list[int]:
    """Rows each chunk's cross-entropy sees (LitGPT's last chunk drops its final position)."""
    rows = [B * n for n in chunk_lengths(loss, S)]
    if loss == "litgpt-chunked-ce":
        rows[-1] -= B
    return rows


def _target_bytes(loss: str, B: int, S: int) -> int:
    """The labels the chunks' nll_loss keeps: torchtune's shifted (B, S) (its chunks' views at B=1,
    copies from B=2); LitGPT's ``targets[..., 1:]`` chunks, views of the labels input at B=1 (no
    new storage), copies from B=2."""
    if loss == "torchtune-chunked-ce":
        return B * S * 8
    return B * (S - 1) * 8 if B > 1 else 0


def check_framework_loss(ctx) -> None:
    """Refuse, naming the field, what these rules were not written for."""
    from trainmem.errors import SpecError
    loss, m = ctx.step.loss, ctx.model
    if ctx.step.dtypes.autocast:
        raise SpecError("precision", ctx.step.precision, f"loss {loss} is modelled for pure fp32/bf16/fp16 and "
                                                         "mixed precisions (the frameworks run no autocast)")
    if m.logit_softcap:
        raise SpecError("loss", loss, "is not modelled with a final logit softcap (Gemma-2): use --loss ce")
    if ctx.shard.tp > 1 or ctx.shard.cp > 1:
        raise SpecError("loss", loss, f"is modelled on unsharded logits (tp=1, cp=1; here tp={ctx.shard.tp}, "
                                      f"cp={ctx.shard.cp}): use --loss ce")
    if loss == "litgpt-chunked-ce" and ctx.S < 2:
        raise SpecError("seq", ctx.S, "must be at least 2 for litgpt-chunked-ce (the last position is dropped)")


def framework_loss_items(ctx, logits) -> None:
    """What the chunked loss keeps, on ``ctx.graph`` under module ``loss`` (rules_hf_parts's ``_loss``):
    torchtune's per chunk (:func:`_torchtune_items`), LitGPT's as one log-softmax for all chunks."""
    check_framework_loss(ctx)
    g, B, S, V = ctx.graph, ctx.B, ctx.S, ctx.model.vocab_size
    loss, rg = ctx.step.loss, logits.requires_grad
    if loss == "torchtune-chunked-ce":
        return _torchtune_items(ctx, rg)
    _litgpt_items(ctx, logits.dtype, rg)


def _litgpt_items(ctx, dtype: str, rg: bool) -> None:
    """What litgpt/utils.py ``chunked_cross_entropy`` (the list branch) keeps, per chunk as it makes
    them (a measured step's items join these per tensor): from B=2 each target chunk's ``reshape(-1)``
    copy (``targets[..., 1:]`` is not contiguous; at B=1 views of the labels input), made together
    before the losses; then per chunk ``cross_entropy(reduction="none")`` on the logits as they are:
    log-softmax and nll_loss's total weight, both in the logits' dtype (a 0-dim tensor); then the
    token count (int64) and the loss value. The last chunk drops its final position."""
    g, B, S, V = ctx.graph, ctx.B, ctx.S, ctx.model.vocab_size
    chunks = [(r, f"B·{n}" if r == B * n else f"B·{r // B}")
              for r, n in zip(_rows("litgpt-chunked-ce", B, S), chunk_lengths("litgpt-chunked-ce", S))]
    if B > 1:
        for c, (r, rdim) in enumerate(chunks):
            g.save(g.new(f"target_chunk{c}", (r,), (rdim,), "int64", False), when=rg)
    for c, (r, rdim) in enumerate(chunks):
        g.save(g.new(f"log_softmax_chunk{c}", (r, V), (rdim, "V"), dtype),
               g.new(f"total_weight_chunk{c}", (), (), dtype, False), when=rg)
    g.save(g.new("token_count", (), (), "int64", False), when=rg)
    loss_value(g, dtype)  # cat(losses).sum() / count, in the logits' dtype (estimate/loss_value.py)


def _chunk_dims(S: int, loss: str = "torchtune-chunked-ce") -> list[tuple[int, str]]:
    """The chunk lengths with their symbol: torchtune's ⌈S/8⌉ each, LitGPT's 128, the last one as a
    number where it is shorter (the dims have no minus)."""
    lens = chunk_lengths(loss, S)
    first = f"⌈S/{TORCHTUNE_CHUNKS}⌉" if loss == "torchtune-chunked-ce" else str(LITGPT_CHUNK)
    return [(n, first if n == lens[0] else str(n)) for n in lens]


def torchtune_head(ctx, h, name: str):
    """torchtune's ``chunked_output``: the head runs on each chunk of ``h.chunk(8, dim=1)`` (LitGPT's
    ``GPT.forward(lm_head_chunk_size=128)`` on each of ``x.split(128, dim=1)``, the same way). From B=2
    a chunk is not contiguous and the linear's ``reshape`` copies it (aten ``matmul`` folds the leading
    axes: a measured step's ``lm_head.clone``); mm keeps that copy for the weight's gradient, one
    (B, len_c, H) item per chunk in the head's module, and ``h`` is not kept. At B=1 each chunk is a view
    of ``h``, kept once (the one head input). Returns the last chunk's logits (their dtype and grad)."""
    g, m = ctx.graph, ctx.model
    H, V = m.hidden_size, m.vocab_size
    out = h
    with g.module(name):
        lora = _lora_head(ctx)
        for c, (n, sym) in enumerate(_chunk_dims(ctx.S, ctx.step.loss)):
            if ctx.B > 1:
                x = g.new(f"input_chunk{c}", (ctx.B, n, H), ("B", sym, "H"), h.dtype, h.requires_grad)
            elif lora:  # the chunk, a view of h: the adapter's dropout makes chunk-sized tensors from it
                x = replace(h, shape=(1, n, H), dims=(h.dims[0], sym, h.dims[-1]), uid=g.key(h))
            else:
                x = h
            out = ctx.linear(x, V, "V", weight=(V, H), label=f"out_chunk{c}")
        if lora and g.saved.get(g.key(h)) is not None:
            g.saved[g.key(h)] = h  # a kept chunk view (dropout p = 0, or a trainable head) keeps h's storage
    return out


def _lora_head(ctx) -> bool:
    """The head is a LoRA target (litgpt/lora.py ``GPT``'s ``lm_head`` a ``LoRALinear`` under
    ``lora_head=True``; peft's ``lora.Linear`` when ``lm_head`` is named)."""
    from trainmem.specs.finetune import lora_targeted
    spec = getattr(ctx.finetune_linear, "spec", None)
    return spec is not None and lora_targeted(".".join(ctx.graph.scope), spec)


def _torchtune_items(ctx, rg: bool) -> None:
    """What ``CEWithChunkedOutputLoss.forward`` keeps, per chunk as it makes them (a measured step's
    items join these per tensor): the shifted labels (B=1: hstack's (B, S), every chunk's target a
    view of it; from B=2 each chunk's ``reshape`` copies it, B·len_c·8), each chunk's fp32 log-softmax
    and nll_loss's total weight (fp32, 4 bytes), and the token count (int64). The same bytes as the
    whole-loss formula of the module docstring."""
    g, B, S, V = ctx.graph, ctx.B, ctx.S, ctx.model.vocab_size
    if B == 1:
        g.save(g.new("target", (B * S,), ("B·S",), "int64", False), when=rg)
    g.save(g.new("token_count", (), (), "int64", False), when=rg)
    for c, (n, sym) in enumerate(_chunk_dims(S)):
        r, rdim = B * n, f"B·{sym}"
        if B > 1:
            g.save(g.new(f"target_chunk{c}", (r,), (rdim,), "int64", False), when=rg)
        g.save(g.new(f"log_softmax_chunk{c}", (r, V), (rdim, "V"), "float32"),
               g.new(f"total_weight_chunk{c}", (), (), "float32", False), when=rg)
    loss_value(g, "float32")  # total_loss / total_elements, after the chunks (estimate/loss_value.py)


@dataclass(frozen=True)
class LossPhases:
    """Bytes beside the kept set: at the end of forward (inside the last chunk), at the loss's
    backward peak, and held by the training loop in every phase (LitGPT's ``logits``)."""

    forward: dict[str, int]
    backward_start: dict[str, int]
    held: int
    head_backward: dict[str, int] | None = None
    """Beside the activations less the loss's kept set, while the head's chunk matmuls run backward
    and their weight gradients are summed (None: one chunk, or no trainable head weight)."""
    head_forward: dict[str, int] | None = None
    """Beside the activations less the loss's kept set, inside the last head chunk's forward (LitGPT
    with a LoRA head only: :func:`_lora_head_forward`); the forward phase takes it when it is larger."""


def framework_loss_phases(loss: str, *, B: int, S: int, V: int, logits_dtype: str, hidden_row_bytes: int = 0,
                          head_weight_grad: int = 0, lora_head_input: int | None = None) -> LossPhases:
    """The pure arithmetic of the module docstring. ``hidden_row_bytes``: H·d (one row of the head's
    input gradient); ``head_weight_grad``: the bytes of the head weight's gradient (0 if frozen);
    ``lora_head_input``: None unless the head has LoRA adapters, else the bytes of the head input
    alive beside the kept set (:func:`lora_head_input`)."""
    d = dtype_bytes(logits_dtype)
    rows = _rows(loss, B, S)
    logits = int(B * S * V * d)
    if loss == "torchtune-chunked-ce":
        upcast = rows[-1] * V * 4 if logits_dtype != "float32" else 0
        labels = B * S * 8 if B > 1 else 0  # hstack's (B, S): the kept chunks are copies from B=2
        # the running sum and the last chunk's summed loss (fp32 scalars)
        fwd = {"logits": logits, "logits_upcast_chunk": upcast, "labels": labels, "loss_scalars": 8}
        lsm_b, work, scalar = 4, 8, 4  # fp32 log-softmax; its gradient and the nll gradient: 2 fp32 chunks
        # chunk i's labels: views of hstack's (B, S) at B=1 (alive until the last one is released)
        targets = [B * S * 8 if i else 0 for i in range(len(rows))] if B == 1 else [r * 8 for r in rows]
        held = 0
    else:
        last_copy = rows[-1] * V * d if B > 1 else 0  # reshape of the sliced last chunk
        # after the loop: torch.cat of the per-row losses beside the list it reads
        fwd = {"logits_copy": int(last_copy), "row_losses": int(2 * sum(rows) * d)}
        lsm_b, work, scalar = d, 2 * d, d
        targets = [r * 8 if B > 1 else 0 for r in rows]  # views of the labels input at B=1
        held = logits
    # what framework_loss_items keeps: log-softmax, labels, a total weight per chunk (fp32 in torchtune's
    # upcast CE, the logits' dtype in LitGPT's), the token count, and the loss value the caller holds
    # (one scalar, estimate/loss_value.py)
    tw = 4 if loss == "torchtune-chunked-ce" else d
    kept = lsm_b * V * sum(rows) + _target_bytes(loss, B, S) + tw * len(rows) + 8 + scalar
    # chunk j's log-softmax backward (newest first): its nll gradient and its own output beside the
    # log-softmax outputs of chunks <= j, the logit gradients (logits' dtype) of chunks > j, the labels
    # and total weights of chunks < j, the loss and its gradient seed, and the loss's gradient while a
    # chunk's nll backward is still to run (j > 0)
    bwd = max(work * r * V + lsm_b * V * sum(rows[:j + 1]) + d * V * sum(rows[j + 1:])
              + (targets[j] if B == 1 else sum(targets[:j])) + tw * j + (3 if j else 2) * scalar
              for j, r in enumerate(rows)) - kept  # the kept set is counted in the activations
    head_fwd = _lora_head_forward(B, S, V, d, lora_head_input) if held and lora_head_input is not None else None
    return LossPhases({k: int(v) for k, v in fwd.items() if v}, {"logits_grad": int(bwd)}, held,
                      _head_backward(loss, B, S, V, d, scalar, hidden_row_bytes, head_weight_grad), head_fwd)


def _lora_head_forward(B: int, S: int, V: int, d: float, head_input: int) -> dict[str, int]:
    """Inside LitGPT's last head chunk with a LoRA head (litgpt/lora.py ``LoRALinear.forward``:
    ``pretrained + lora``, ``lora = (dropout(x) @ lora_A.T @ lora_B.T) * scaling``, the matmul's output
    freed by the scaling): the frozen output, the scaled adapter output and their sum, three chunk-sized
    logits, beside the earlier chunks' logits and the head input (``GPT.forward``'s ``x``). The loss has
    kept nothing yet; the loop's ``logits`` (the held ledger) are the previous micro-batch's, still bound
    until this forward returns (litgpt/finetune/lora.py ``fit``). Measured on CPU against litgpt 0.5.13
    (tests/estimate/test_litgpt_lora_head.py): with a wide vocabulary this tops the loss backward."""
    lens = chunk_lengths("litgpt-chunked-ce", S)
    parts = {"logits": d * V * B * sum(lens[:-1]), "head_chunk": 3 * d * V * B * lens[-1], "head_input": head_input}
    return {k: int(v) for k, v in parts.items() if v}


def lora_head_input(items, B: int, S: int, hidden_row_bytes: int) -> int | None:
    """None unless the head has LoRA adapters (``lm_head.lora_*`` parameters) over a 16/32-bit weight; else
    the head input's bytes (B·S·H·d), 0 where it is kept already (B=1 with a trainable head weight: mm keeps
    it whole). A 4-bit head (``--quantize-head``: ``lm_head.weight.absmax`` and the like) is left to the
    forward phase as before: its dequantized weight is alive at that moment too, not modelled here."""
    from trainmem.inventory import Category, Inventory
    base = items.base if isinstance(items, Inventory) else items
    params = [i.name for i in base if i.category is Category.PARAMETER and i.name.startswith("lm_head.")]
    if not any(n.startswith("lm_head.lora_") for n in params) or any(n.startswith("lm_head.weight.") for n in params):
        return None
    kept = B == 1 and any(i.category is Category.GRADIENT and i.name.startswith("lm_head.weight") for i in base)
    return 0 if kept else B * S * hidden_row_bytes


def _head_backward(loss, B, S, V, d, scalar, hidden_row_bytes, head_weight_grad) -> dict[str, int] | None:
    """Every chunk's loss backward runs before the head's matmuls (higher sequence numbers), newest
    chunk first. The second matmul's weight gradient is summed with the first's out of place
    (autograd's InputBuffer.accumulate: ``old + new``), so three weight-sized tensors are alive, beside
    the logit gradients of the chunks still to run (chunks 0..n-3, in the logits' dtype) and the two
    chunks' input gradients (from B=2 they replace the two chunk copies their matmuls kept and freed).
    With logits wider than the hidden state this is the stage's top; the loss and its seed are alive."""
    lens = chunk_lengths(loss, S)
    if len(lens) < 2 or not head_weight_grad:
        return None
    grads = d * V * B * sum(lens[:-2])
    hidden = hidden_row_bytes * B * (lens[-1] + lens[-2]) if B == 1 else 0
    parts = {"logits_grad": grads, "head_weight_grads": 3 * head_weight_grad, "hidden_grads": hidden,
             "loss_scalars": 2 * scalar}
    return {k: int(v) for k, v in parts.items() if v}
