"""``--compile`` under FSDP2 (``--dp N --fsdp full``): which parallel layouts the compiled rules cover.

FSDP2 keeps its hooks out of Dynamo: ``_pre_forward``/``_post_forward`` and the backward hooks of
``FSDPState`` are wrapped by ``_dynamo_disable`` (``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``,
``torch._dynamo.disable(..., recursive=True, reason="skipping FSDP hooks")``; torch 2.4-2.6 read
``torch._dynamo.config.skip_fsdp_hooks`` for the same purpose). Whether the block is compiled before
``fully_shard`` (torchtitan's ``apply_compile``, torchtune's ``compile_model`` then ``shard_model``) or
after, the all-gather runs eagerly before the compiled region and the region's inputs are the unsharded
parameters (views of FSDP's all-gather outputs): it partitions exactly as on one device and saves the same
set. So a rank keeps the one-device compiled saved set at its own batch, and FSDP2's timeline (sharded
states, all-gather and reduce-scatter buffers, ``estimate/fsdp_streams.py``) is unchanged. Checked with
the real ``fully_shard`` and per-block ``torch.compile`` in the fake process group
(``tests/trace/test_trace_compile_fsdp.py``: each region's saved values equal the one-device regions'; the
estimate's ledgers and saved set equal the trace's, ``tests/estimate/test_compiled_fsdp.py``).

Under ``fsdp-bf16`` (``MixedPrecisionPolicy(param_dtype=bfloat16)``) the compiled block reads bf16
gathered weights and bf16 activations: pure bf16's saved set.

HSDP (``--fsdp hybrid --fsdp-group G``) is ``fully_shard`` on a ``(dp_replicate, dp_shard)`` mesh whose hooks
are the same dynamo-disabled ones (trace/parallel_2d.py): a rank allocates what FSDP2 over its G shard ranks
does and its compiled blocks save the one-device set (tests/estimate/test_compiled_hsdp.py: estimate ==
FSDP2 over G to the byte; against the 2-D trace, ledgers and saved set to the byte).

Pipeline parallelism (``--pp N``, ``--compile-scope block``): torchtitan cuts the model into stage models and
then runs ``parallelize_fn`` (``apply_compile``: each block compiled) on each, so a stage's blocks are
one-device compiled regions and a stage keeps, per micro-batch in flight, the compiled saved set of its own
blocks; with FSDP2 per stage as above (tests/estimate/test_compiled_pp.py; against the real schedule with
compiled stages, tests/trace/test_trace_pp_compile.py). ``--compile-scope block-loss`` (torchtitan's default
``[compile] components = ["model", "loss"]``) compiles the last stage's loss too: its saved set goes to the last
stage, the logits it saves being the schedule's output chunk (estimate/parallel_pp.py ``output_chunk_aliases``).

Known limitations (refused by :func:`check_compiled_parallel`, one line each):
  - FSDP1: not traced with compile; under pipeline parallelism the ``model`` scope (whole-model compile of
    a stage is not traced) and schedules other than gpipe and 1f1b;
  - activation offload, and FSDP2 CPU offload (``--offload params[,optimizer]``) other than with ``--fsdp full``,
    no pipeline stages and ``--recompute none`` or ``full``: CPUOffloadPolicy only moves the shards (the
    compiled block's inputs are the device's unsharded parameters as without it), checked against a real
    2-rank gloo run with compiled blocks (tests/parallel/test_fsdp_offload_compile.py: host states, gathered
    parameters and saved activations to the byte; device peak 1.017 fp32, 0.975 fsdp-bf16 with full
    recompute); tensor/context/expert parallelism is refused by ``rules_compiled.check_compiled``;
  - ``--recompute op`` with FSDP2 and pipeline stages: under 1F1B and ``--fsdp full`` the blocks' moments are
    counted beside FSDP2's unsharded gradient buffer (estimate/parallel_pp.py ``fsdp_stage_moments``), equal to the
    fp32 and bf16 traces (``trace --pp`` refuses fsdp-bf16: not checked); GPipe reads 1.03 and stays refused.
    Under FSDP2 and HSDP a block's backward moment is the one-device one (estimate/compiled_op_moment.py; the
    0.855 read before was that moment, missing):
    tiny Llama B 2 S 64, estimate == trace 2,325,960 B fp32, 1,846,472 B fsdp-bf16, 1,371,912 B bf16 (HSDP dp 4
    group 2 against the 2-D trace: 2,325,960 B fp32, 1,846,472 B fsdp-bf16);
    Qwen2 (q/k/v biases, the attention's recompute deferred) fp32 2,276,808 B, fsdp-bf16 1,780,936 B.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec, ParallelSpec

__all__ = ["check_compiled_parallel"]


def check_compiled_parallel(impl: ImplSpec, par: ParallelSpec, recipe: str | None = None) -> None:
    """Refuse ``--compile`` with a parallel layout the compiled rules were not checked under (``recipe``: the
    step's precision recipe, ``StepSpec.recipe``, where the caller knows it)."""
    if not impl.compile or par.is_single:
        return
    refusals = (
        # torchtitan compiles each stage model's blocks (apply_compile inside parallelize_fn, per stage)
        ("compile_scope", impl.compile_scope, par.pp > 1 and impl.compile_scope not in ("block", "block-loss"),
         "compiled stages under pipeline parallelism are traced with per-block compile (--compile-scope block "
         "or block-loss)"),
        ("schedule", par.schedule, par.pp > 1 and par.schedule not in ("gpipe", "1f1b"),
         "compiled stages are traced under the gpipe and 1f1b schedules"),
        ("fsdp_version", par.fsdp_version, bool(par.fsdp) and par.fsdp_version == 1,
         "FSDP1's flat parameters under compile are not traced (FSDP2 is: --fsdp-version 2)"),
        # CPUOffloadPolicy moves the shards, not the compiled block's inputs (estimate/fsdp_offload.py); checked
        # against a real gloo run (tests/parallel/test_fsdp_offload_compile.py)
        ("offload", ",".join(par.offload), bool(par.fsdp) and bool(par.offload) and (
            "activations" in par.offload or par.fsdp != "full" or par.pp > 1
            or impl.recompute not in ("none", "full")),
         "compiled blocks under FSDP2 are checked with CPU offload of the sharded states (--fsdp full --offload "
         "params[,optimizer], --recompute none or full), not with activation offload, HSDP or pipeline stages"),
        # op per block: estimate/compiled_op_moment.py, traced under FSDP2 and HSDP, and per pipeline stage under
        # 1F1B with --fsdp full (estimate/parallel_pp.py fsdp_stage_moments; GPipe read 1.03 of the trace, not
        # explained)
        ("recompute", impl.recompute, bool(par.fsdp) and impl.recompute not in ("none", "full") and not (
            impl.recompute == "op" and (par.pp == 1 or (par.fsdp == "full" and par.schedule == "1f1b"))),
         "compiled blocks under FSDP2 are checked with --recompute none or full, and op without pipeline stages or "
         "with them under 1f1b and --fsdp full"),
        # estimate/compiled_float8_recompute.py; --recompute none: compiled_float8_moment.py,
        # compiled_float8_rowwise.py, compiled_float8_gathered.py (the fp8 all-gather); pipeline stages, with or without FSDP2: trace --pp refuses
        # Float8, so no stage's Float8 block moments are checked
        # amp-bf16 op per stage: the stage reads under its trace at full recompute already (tiny Llama, 4 layers,
        # pp 2, 4 micro-batches, B 2 S 64: GPipe rank 0 -131,072 B, 0.955), and under op (GPipe rank 0 0.960,
        # 1F1B 0.962 / 0.952; GPipe rank 1 ==); estimate/parallel_pp.py's stage under autocast, not the op moment
        ("recompute", impl.recompute, recipe == "amp-bf16" and impl.recompute == "op" and impl.float8 == "none"
         and par.pp > 1, "compiled op-level checkpointing under amp-bf16 is checked without pipeline stages"),
        ("float8", impl.float8, impl.float8 != "none" and par.pp > 1,
         "compiled Float8 is checked without pipeline stages (trace --pp refuses Float8)"),
    )
    for field, value, bad, why in refusals:
        if bad:
            raise UnsupportedError(f"compile: {field}={value!r} is not modelled: {why}")
