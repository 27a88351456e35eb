"""Pipeline stages: which layers each stage owns, which stage keeps each item, and how many
micro-batches' activations a stage holds at once under each schedule (GPipe, 1F1B, interleaved
1F1B, zero-bubble). Pure functions of the model's depth and the :class:`~trainmem.specs.ParallelSpec`;
:func:`trainmem.estimate.parallel.rank_classes` composes them with the sharding steps of
:mod:`trainmem.estimate.parallel_zero` and the rank-local model of :mod:`trainmem.estimate.parallel_tp`.
"""

from __future__ import annotations

from trainmem.estimate.pp_schedule import rank_actions, timeline
from trainmem.inventory import MemoryItem
from trainmem.names import is_embedding_indices, is_head, is_token_embedding, layer_index
from trainmem.specs import ModelSpec, ParallelSpec

__all__ = ["stage_layers", "in_flight", "apply_pp", "recv_input_aliases", "output_chunk_aliases", "stage_node_moments",
           "later_microbatch", "with_later_microbatch", "sent_input_grad", "without_recv_aliases", "caller_batch",
           "optimizer_batch", "fsdp_stage_moments"]


_RECV_NOTE = "the stage's receive buffer (buffers.pp_recv_activations)"


def stage_layers(model: ModelSpec, par: ParallelSpec) -> list[tuple[int, int]]:
    """[start, end) layers of each pipeline stage (first stages take the remainder)."""
    if par.layer_split:
        sizes = list(par.layer_split)
    else:
        base, rem = divmod(model.num_layers, par.pp)
        sizes = [base + (1 if s < rem else 0) for s in range(par.pp)]
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def in_flight(par: ParallelSpec, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once, in units of the stage's layers.

    GPipe holds all of them; 1F1B (and zero-bubble ZB-H1, which keeps 1F1B's memory) holds
    ``pp - stage``; interleaved 1F1B with v chunks holds the most chunks its run order
    (estimate/pp_schedule.py, torch's ``ScheduleInterleaved1F1B``) keeps at once: the warm-up
    forwards plus one, each chunk being 1/v of the stage.
    """
    m, pp = par.microbatches, par.pp
    if pp == 1:
        return 1
    if par.schedule == "gpipe":
        return m
    if par.schedule == "interleaved":
        v = par.virtual_stages
        return timeline(rank_actions("interleaved", pp=pp, v=v, m=m, rank=stage), [1 / v] * v, [0.0] * v).max_held
    return min(pp - stage, m)


def _stage_of(name: str, stages: list[tuple[int, int]]) -> int:
    """A block's item goes with its block, a head's (final norm, output layer, loss) to the last
    stage, everything else (embeddings, rotary tables) to the first."""
    li = layer_index(name)
    if li is not None:
        return next(s for s, (a, b) in enumerate(stages) if a <= li < b)
    return len(stages) - 1 if is_head(name) else 0


def apply_pp(items, stage_of, stage: int) -> list[MemoryItem]:
    """The items stage ``stage`` keeps (``stage_of``: each item's stage, in order)."""
    return [it for it, st in zip(items, stage_of) if st == stage]


def recv_input_aliases(stage_acts: list[MemoryItem], first_layer: int) -> list[MemoryItem]:
    """A receiving stage's input as its first block saves it, given as what it is: the receive buffer.
    ``_PipelineStageBase._retrieve_recv_activations`` (torch/distributed/pipelining/stage.py) hands
    the forward ``info.buffer`` itself (detached, a view of the same storage), so the block input
    the stage keeps per micro-batch (the item of a layer before ``first_layer`` that ``_stage_of``
    gave this stage) is ``buffers.pp_recv_activations``, not a tensor of its own: 0 bytes here."""
    return [_aliased(it, _RECV_NOTE)
            if (li := layer_index(it.name)) is not None and li < first_layer else it for it in stage_acts]


def without_recv_aliases(items: list[MemoryItem]) -> list[MemoryItem]:
    """``items`` less the receive-buffer aliases of :func:`recv_input_aliases`, for the stage's phases: such an
    item is named after the previous stage's last block, which would make that block the stage's first one
    (``peak.phases`` takes its blocks from the layers its activations name) and the first block's backward
    moment would be read off a block the stage does not run. Its bytes are 0: the sum is unchanged."""
    return [it for it in items if it.__dict__.get("note") != _RECV_NOTE]


def output_chunk_aliases(stage_acts: list[MemoryItem]) -> list[MemoryItem]:
    """The last stage's logits as the compiled loss saves them (``--compile-scope block-loss``,
    ``rules_compiled._compiled_loss`` keeps its input, the (B, S, V) head output), given as what they are:
    the schedule's output chunk. ``_PipelineStageBase.forward_one_chunk`` (torch/distributed/pipelining/
    stage.py) stores the stage's output in ``output_chunks`` and the schedule's ``_maybe_compute_loss``
    passes that very tensor to the loss, so the region's saved input is ``buffers.pp_output_chunks``'
    storage: 0 B here. The loss's own tensors (under ``loss.``) are new storages and stay."""
    return [_aliased(it, "the schedule's output chunk (buffers.pp_output_chunks)")
            if it.dims[-1:] == ("V",) and is_head(it.name) and not it.name.startswith("loss.") else it
            for it in stage_acts]


def stage_node_moments(par: ParallelSpec) -> bool:
    """Whether a stage's peak takes its blocks' node moments (estimate/block_backward.py, and a checkpointed
    compiled block's, estimate/compiled_recompute.py) beside the schedule's buffers: torch.distributed.pipelining
    (gpipe, 1f1b), one rank per stage. The stage's last block's eager moments before its residual sum read the
    received output gradient, the receive buffer itself (``_PipelineStageBase.backward_one_chunk`` passes
    ``_retrieve_recv_grads``' buffers to ``stage_backward``, torch/distributed/pipelining/stage.py): counted
    once, in ``pp_recv_gradients`` (peak.py ``grad_received``). A compiled region's backward makes its own
    residual gradient beside that buffer (measured: counting it once more matched the trace, 0.9993 of it).
    Measured against the trace (tests/trace/test_trace_pp.py, test_trace_pp_compile.py); not taken under
    FSDP2 per stage (its unsharded gradients accumulate in a buffer the moments would count again: 1.0045
    of the trace with them, 0.9942 without), the interleaved schedule (1.0074, 0.9977 without: not
    understood), nor with data, tensor or context parallel ranks beside the stages (not traced)."""
    return par.pp > 1 and par.schedule in ("gpipe", "1f1b") and par.dp * par.tp * par.cp == 1 and not par.fsdp


def later_microbatch(par: ParallelSpec, items: list[MemoryItem], body: int) -> list[MemoryItem] | None:
    """A GPipe stage's items as its second micro-batch's backward sees them: one micro-batch fewer in flight
    (``pipeline.in_flight_microbatches`` less ``body``, one micro-batch's stage activations, but for what outlives
    the first micro-batch's backward: its token ids, a view of the caller's batch, and its loss, which the schedule
    keeps: :func:`_outlive`), to be run with the gradients accumulated (every gradient of the stage stored, the
    block's new ones beside them). GPipe runs every forward, then every backward (``ScheduleGPipe._step_microbatches``,
    torch/distributed/pipelining/schedules.py): the first backward holds every micro-batch's activations and the
    stage's first gradients only, the second one micro-batch less and every gradient (``stage_backward``
    accumulates into ``.grad``); later ones hold less than the second. Where a block's backward moment is large
    beside one micro-batch's activations (a compiled block under ``--recompute op``: the recomputed attention and
    SiLU's fp32 temporaries) the second is the stage's peak. ``None`` where it does not apply: other schedules
    (1F1B's phases are already the accumulated ones), one micro-batch, or where the stage takes no node moments
    (:func:`stage_node_moments`)."""
    if not (stage_node_moments(par) and par.schedule == "gpipe" and par.microbatches > 1):
        return None
    name, freed = "pipeline.in_flight_microbatches", body - _outlive(items)
    return [MemoryItem.make(it.name, it.category, it.shape, it.dtype, it.bytes - freed,
                            f"({par.microbatches:g} − 2) × stage activations", it.dims, it.key)
            if it.name == name else it for it in items]


def _outlive(items: list[MemoryItem]) -> int:
    """What of one micro-batch's stage items outlives its backward: the token embedding's indices (a view of the
    caller's batch: :func:`caller_batch`) and the loss (the schedule's ``_internal_losses``)."""
    return sum(it.bytes for it in items if it.name == "loss.value" or (
        is_token_embedding(it.name) and is_embedding_indices(it.name)))


def caller_batch(par: ParallelSpec, stage: int, items: list[MemoryItem], *, batch: int, seq: int) -> dict[str, int]:
    """What the caller's batch adds beside a stage's items in each phase but the optimizer's (there the whole batch
    is counted by :func:`optimizer_batch`), under torch.distributed.pipelining. The caller passes the whole batch to
    ``step()`` (torchtitan's ``pp_schedule.step(inputs)`` on the first stage, ``step(target=labels, losses=...)``
    on the last) and holds it until ``step()`` returns; ``split_args_kwargs_into_chunks``
    (torch/distributed/pipelining/microbatch.py) cuts it with ``torch.tensor_split``, views:

    * first stage: the token ids, m·B·S·8, of which the embedding saves each in-flight micro-batch's chunk
      (counted as its activation, ``n`` micro-batches at once: :func:`in_flight`): (m − n)·B·S·8 more (GPipe
      and 1F1B; not under interleaved 1F1B, whose ``n`` counts chunks of the rank's virtual stages);
    * last stage: the targets, m·B·S·8 (the loss keeps its own shifted copy per micro-batch, ``loss.target``);
      and the losses ``_maybe_compute_loss`` appends to ``_internal_losses`` (schedules.py), each kept until
      ``step()`` returns: under 1F1B m − 1 beside the one the stage counts (GPipe counts every micro-batch's).

    Measured against the fake-process-group trace (tests/estimate/test_compiled_pp_op.py): the gaps these close
    were 2,048 B (1F1B rank 0), 4,108 B (rank 1) and 4,096 B (GPipe rank 1) at the tiny Llama's peak."""
    ids = batch * seq * 8  # int64 token ids of one micro-batch
    m, n, last = par.microbatches, in_flight(par, stage), par.pp - 1
    out = {}
    # interleaved: n counts the rank's virtual stages' chunks, not the first one's micro-batches (ids not added)
    if stage == 0 and par.schedule != "interleaved" and any(
            is_token_embedding(i.name) and is_embedding_indices(i.name) and i.bytes for i in items):
        out["pp_batch_ids"] = int((m - n) * ids)
    if stage == last:
        loss = sum(i.bytes for i in items if i.name == "loss.value")
        out["pp_batch_targets"] = m * ids
        out["pp_losses"] = (m - (m if par.schedule == "gpipe" else 1)) * loss if loss else 0
    return {k: v for k, v in out.items() if v}


def optimizer_batch(par: ParallelSpec, items: list[MemoryItem], *, batch: int, seq: int, loss: str) -> int:
    """The caller's batch on a rank while ``optimizer.step()`` runs (``PhaseInputs.optimizer_batch``): its int64
    token ids, bound by the training loop for the whole step. ``seq``: the rank's (CP-local) sequence.

    * no pipeline: the rank's (B, S) ids, S the whole sequence under CP too: torch's ``context_parallel`` shards
      the batch in place (``_context_parallel_buffers``, torch/distributed/tensor/experimental/_context_parallel/
      _attention.py: ``buffer.resize_(shard.shape)``), and a smaller ``resize_`` keeps the storage;
    * a pipeline: the whole batch, m·B·S·8, on the first stage (the ids ``step()`` was given) and on the last (the
      targets); none on the others (:func:`caller_batch`'s tensors; the schedule's losses list is ``step()``'s
      own and gone by then, as the trace runs it: trace/parallel_pp.py ``step``).

    As the trace counts them (its inputs, every phase: tests/trace/test_trace_2d.py, test_trace_pp.py)."""
    ids = batch * seq * par.cp * 8
    if par.pp == 1:
        return ids
    first = any(is_token_embedding(i.name) for i in items)
    return int(par.microbatches * ids) * ((1 if first else 0) + (1 if loss != "none" else 0))


def sent_input_grad(working: dict[str, dict[str, int]], one: int) -> dict[str, dict[str, int]]:
    """A GPipe stage's working buffers at its second micro-batch's backward (:func:`later_microbatch`): the first
    micro-batch's input gradient, which ``backward_one_chunk`` returned and the schedule sent
    (``_PipelineStageBase.get_bwd_send_ops``, torch/distributed/pipelining/stage.py), is still held beside the
    backward phases' buffers (every one of them is at ``backward_end``: ``pp_sent_input_grads``). ``one``: one
    micro-batch's boundary gradient (B·S·H in the residual stream's dtype). A first stage sends none."""
    if not working.get("backward_end", {}).get("pp_sent_input_grads"):
        return working
    return {k: {**v, "pp_sent_input_grads": v.get("pp_sent_input_grads", 0) + one}
            if k.startswith("backward") and k != "backward_end" else v for k, v in working.items()}


def with_later_microbatch(first: list, later: list) -> list:
    """``first``'s phases, each backward one (``backward*``) the larger of the first micro-batch's and the
    second's (:func:`later_microbatch`); forward and optimizer phases are the first's (every forward runs before
    any gradient exists)."""
    by_name = {p.name: p for p in later if p.name.startswith("backward")}
    return [max(p, by_name[p.name], key=lambda q: q.bytes) if p.name in by_name else p for p in first]


def fsdp_stage_moments(par: ParallelSpec, impl) -> int:
    """FSDP2 full sharding per pipeline stage under 1F1B (no TP or CP), blocks compiled around a checkpoint
    (``--recompute full`` or ``op``): the shard group size, with which a stage's block takes its node moments
    (``peak.phases``'s ``fsdp_pp_grads``), else 0. FSDP2 under PP keeps every unsharded gradient until the last
    micro-batch's backward (``buffers.fsdp_pp_unsharded_grads``, all phases), so a node moment holds beside it only
    the block's new gradients, unsharded (the compiled backward returns them whole; FSDP2's post-backward hook
    accumulates them into that buffer afterwards). Measured (tiny Llama fp32, pp 2, dp 2, m 4, both ranks): op and
    full recompute == the trace (tests/trace/test_trace_pp_compile_op.py); not taken where it was not: eager blocks
    (1.0098 of the trace on rank 0 with the moments, 0.9942 without) and GPipe (op: 1.04, not understood)."""
    ok = (par.pp > 1 and par.schedule == "1f1b" and par.fsdp == "full" and par.fsdp_version == 2
          and par.tp * par.cp == 1 and impl.compile and impl.compile_scope != "model"
          and impl.recompute in ("full", "op"))
    return par.dp if ok else 0


def _aliased(it: MemoryItem, note: str) -> MemoryItem:
    """``it`` as a view of a storage another item counts: 0 bytes, with a note saying which."""
    out = MemoryItem.make(it.name, it.category, it.shape, it.dtype, 0, "0", it.dims, it.key)
    out.__dict__["note"] = note
    return out
