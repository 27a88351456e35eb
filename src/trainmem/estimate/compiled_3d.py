"""``--compile --compile-scope block`` with TP (``--tp N --sp``) and the layouts it composes with: FSDP2 full sharding
(``--dp D --fsdp full``), pipeline stages (``--pp P``, gpipe and 1f1b) and both, torchtitan's 3-D layout.

torchtitan cuts the model into stage models first (``torchtitan/distributed/pipeline_parallel.py``
``pipeline_llama`` / ``pipeline_module_split``), then runs ``parallelize_fn`` on each stage model
(``torchtitan/models/llama3/infra/parallelize.py`` ``parallelize_llama``): ``apply_tp`` on the ``tp`` sub-mesh,
``apply_ac``, ``apply_compile`` (each block of the stage compiled on its own) and ``apply_fsdp`` on the
``dp_shard`` sub-mesh. The schedule (``torch/distributed/pipelining/schedules.py``) calls the stage model,
whose blocks are each one compiled region; a region's inputs are the previous block's output (or what the
stage received, ``_PipelineStageBase._retrieve_recv_activations``, stage.py) and the block's TP-local DTensor
weights (FSDP2's hooks run eagerly outside the region: ``_fsdp_common.py`` ``_dynamo_disable``). Neither the
cut nor FSDP2 reaches inside a region, so each block partitions as under TP alone and keeps the compiled TP
set (estimate/compiled_tp.py) at the rank's shapes, once per micro-batch the stage holds at once
(estimate/parallel_pp.py ``in_flight``); the receiving stage's first block input is its receive buffer
(``recv_input_aliases``), on S/tp tokens under SP as in eager. Everything else (stage cut, schedule buffers,
FSDP2's sharded states over the TP-local shards) is the eager 3-D estimate's (estimate/parallel.py
``rank_classes``): the composition adds no arithmetic of its own. Exact (==) in
tests/estimate/test_compiled_3d.py: a stage's block items are the TP-only compiled estimate's by name, its
``pipeline.in_flight_microbatches`` that set's (in flight - 1) multiple, its states the eager 3-D ones.

Traced (trace/parallel_pp.py: TP on the tp slice of a (pp[, dp], tp) fake mesh, the residual stream crossing stages
as the rank's S/tp tokens, each stage's blocks compiled; tests/estimate/test_compiled_3d.py, slow): tiny Llama
(4 layers, tp 2 with SP, pp 2, 4 micro-batches, B 2, S 64), GPipe and 1F1B, fp32 and bf16, FSDP2 over dp 2 too,
both ranks: parameters, gradients, AdamW states, receive buffers and one micro-batch's compiled saved set equal
the estimate's to the byte (fp32: 577,536 B on rank 0; 708,868 B on rank 1 = 692,488 + its 16,384 B received
input, the receive buffer, - the 4 B loss). Step peak estimate/trace: rank 0 0.884-0.996 (the trace peaks inside a
compiled block's unfused backward, as under PP alone), rank 1 1.023-1.100 (the TP trace's loss_parallel gap:
trace/parallel_tp.py). Not checked against a real gloo step of the 3-D layout (its parts are:
tests/trace/test_trace_compile_tp.py, test_trace_compile_2d.py, test_trace_pp_compile.py).

Refused in one line (:func:`check_compiled_tp_layout`), as not checked: HSDP, DDP and ZeRO beside TP, context
and expert parallelism, FSDP1; under PP the interleaved and zero-bubble schedules (estimate/compiled_sharded.py)
and the ``block-loss`` scope (compiled_tp.py: the loss under ``loss_parallel`` is eager in torchtitan);
``--recompute full`` stays refused under compiled TP: torch 2.13 itself fails that step, a real gloo one too
(compiled_tp.py ``CHECKPOINTED_TP_BLOCK_FAILS``), so torchtitan's published 70B 2-D and 405B 3-D runs
(``activation_checkpointing: full``, torch of Dec 2024) are estimated without ``--compile``.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError

__all__ = ["check_compiled_tp_layout"]


def check_compiled_tp_layout(impl, par) -> None:
    """Refuse, in one line, ``--compile`` with TP beside a parallel dimension it was not checked with: TP may
    go with FSDP2 ``full`` on the dp sub-mesh and with pipeline stages (the schedule is checked by
    estimate/compiled_sharded.py ``check_compiled_parallel``)."""
    if not impl.compile or par.tp == 1:
        return
    fsdp2_full = par.fsdp == "full" and par.fsdp_version == 2
    others = {"dp": 1 if fsdp2_full else par.dp, "cp": par.cp, "ep": par.ep, "zero": par.zero or 1}
    extra = {k: v for k, v in others.items() if v != 1}
    if extra or (par.fsdp and not fsdp2_full):
        raise UnsupportedError(f"compile: parallel='tp={par.tp} " + " ".join(f"{k}={v}" for k, v in extra.items())
                               + (f" fsdp={par.fsdp}" if par.fsdp else "")
                               + "' is not modelled: compiled blocks under TP are checked alone, with FSDP2 "
                               "full sharding (--dp N --fsdp full) and with pipeline stages (--pp N)")
