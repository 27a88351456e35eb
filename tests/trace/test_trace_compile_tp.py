"""``trace --compile --compile-scope block --tp N --sp``: DTensor TP (``parallelize_module``) and then each block
compiled (partitioned as inductor does, no codegen), as rank 0 of torch's fake process group, against a real
2-rank gloo step of the same compiled model (``measure_dist/worker.py``, strategy ``tp``, ``compile="partition"``:
the same backend on real tensors and real collectives) and against ``estimate`` (``estimate/compiled_tp.py``).

Measured on the tiny Llama (hidden 64, 2 blocks, 4 heads, 2 K/V heads, FFN 176, vocab 256, untied), B 2, S 64,
AdamW, tp 2 with sequence parallelism:
  - each compiled region's saved values == the real run's, region by region (block 1's to the node name,
    block 0's in shape, dtype and bytes: its input arrives as an async collective on gloo);
    the saved set autograd holds == the real run's (fp32 709,892 B, bf16 398,596 B; eager TP: 865,540 B
    and 509,188 B) and == the estimate's activations - 4 B (the fp32 loss the caller holds);
  - parameters, gradients, AdamW states == the real run's and the estimate's to the byte;
  - with inductor itself (worker compile="inductor", C++ code; measured once, ~200 s, not run here) the real
    step saves the same bytes and reads the same op-boundary peak as with trainmem's backend;
  - the real step's allocator peak (torch.profiler ``profile_memory``, the least of three steps on both ranks,
    less AdamW's 84 B of step counters, plus the 1,024 B of input ids made before the profiled window) == the
    estimate's == the trace's - 512 B in both precisions: a (64,) int64, the model's position ids ``model.add``,
    alive at the trace's peak and not at the real one (why is not explained here). The peak is inside
    loss_parallel's fused cross-entropy backward, whose local tensors the trace records
    (trace/dtensor_handlers.py); the op-boundary tracker (LiveTracker, a mode above DTensor) cannot see them
    and reads 118 KB (fp32) and 94 KB (bf16) lower (before, estimate/trace 1.0725 and 1.0991).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from compiled_regions import BLOCK, comparable, trace_with_regions  # noqa: E402

from trainmem.cli import main  # noqa: E402
from trainmem.specs import ParallelSpec, StepSpec  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
TP_SP = ParallelSpec(tp=2, sp=True)


@pytest.mark.parametrize("argv,field", [
    (["--tp", "2", "--sp", "--compile"], "compile_scope='model'"),
    (["--tp", "2", "--sp", "--compile", "--compile-scope", "block-loss"], "compile_scope='block-loss'"),
    (["--tp", "2", "--compile", "--compile-scope", "block"], "sp=False"),
    (["--tp", "2", "--sp", "--compile", "--compile-scope", "block", "--recompute", "full"], "recompute='full'"),
])
def test_what_the_compiled_tp_trace_cannot_run_is_one_line(capsys, argv, field):
    rc = main(["trace", "--model", "llama-3-8b", "--seq", "16", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--compile with --tp" in err and field in err, err


@pytest.mark.slow  # one traced forward that fails (~10 s)
def test_the_fake_process_group_fails_a_checkpointed_compiled_tp_block_as_a_real_one(monkeypatch):
    """The refusal above is torch's: with it lifted, the fake-PG trace fails where the real gloo step fails
    (tests/parallel/test_compiled_tp_checkpoint_real.py: AOTAutograd's save_from_forward, the DeviceMesh read as a
    saved tensor). When a torch release fixes it, this fails: lift the refusal and model the step then."""
    from trainmem.trace import parallel_tp, trace_step

    monkeypatch.setattr(parallel_tp, "_check_compiled", lambda par, impl: None)
    with pytest.raises(AssertionError, match="tensors_saved_with_vc_check to be Tensors.*DeviceMesh"):
        trace_step(LLAMA, StepSpec(batch=2, seq=64, optimizer="adamw"), replace(BLOCK, recompute="full"),
                   parallel=TP_SP)


@functools.lru_cache(maxsize=None)
def _traced(precision: str, loss_parallel: bool = True):
    """The trace and every region its compiled blocks partitioned (``trace/compiled.py`` saved_values)."""
    return trace_with_regions(LLAMA, StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw"), BLOCK,
                              replace(TP_SP, loss_parallel=loss_parallel))


@functools.lru_cache(maxsize=None)
def _real() -> dict[str, list[dict]]:
    from trainmem.measure_dist.launch import run_torchrun_many

    cases = ("fp32", "bf16")
    scenarios = [dict(strategy="tp", config=LLAMA, precision=p, sp=True, compile="partition", tracked_repeats=3,
                      profile_step=True) for p in cases]
    return dict(zip(cases, run_torchrun_many(2, scenarios, timeout=900)))


def _ledgers(items) -> dict[str, int]:
    out: dict[str, int] = collections.defaultdict(int)
    for it in items:
        out[it.category.value] += it.bytes
    return out


@pytest.mark.slow  # one torchrun launch (2 ranks, ~75 s) and two traces (~55 s each) on 2 shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_tp_trace_equals_a_real_gloo_step(precision):
    traced, regions = _traced(precision)
    ranks = _real()[precision]
    assert [r["rank"] for r in ranks] == [0, 1]
    real = ranks[0]
    # the regions partitioned while the traced step first ran (both blocks: one Dynamo entry each), as the
    # real run's, value by value: block 1's to the node name and order; block 0's in shape, dtype and bytes.
    # Its input is the embedding's reduce-scatter, on gloo an AsyncCollectiveTensor whose wait Dynamo puts
    # inside the graph, and the real partition then names and orders other nodes of the same size (measured:
    # bf16 saves that wait_tensor for the block input and add_3, the residual sum, for o_proj's output; fp32
    # only renumbers one)
    got = [comparable(region) for region in regions[:2]]
    want = [comparable(region) for region in real["compiled_regions"]]
    assert len(got) == len(want) == 2 and got[1] == want[1]
    assert sorted(v[1:] for v in got[0]) == sorted(v[1:] for v in want[0])
    assert traced.meta["compile"]["saved_compiled_bytes"] == real["activation_bytes"]
    led = _ledgers(traced.items)
    for ledger in ("parameter", "gradient", "optimizer_state", "buffer"):
        assert led[ledger] == real["states_bytes"][ledger], ledger
    assert real["states_bytes"]["optimizer_step"] == 84  # 21 AdamW step counters, not in the trace
    # the allocator's peak, least over both ranks' three steps (a collective buffer freed on gloo's thread is never
    # recorded: measure_dist/worker.py _profiled_peak); - the step counters, + the ids (B·S·8); the module docstring
    profiled = [p for r in ranks for p in r["profiled_peaks_bytes"]]
    # equal when one of the six readings missed no gloo-thread free (measured: equal, twice); at most the
    # 131,072 B seen in CI (test_trace_tp_real.py)
    over = min(profiled) - 84 + 2 * 64 * 8 - (traced.peak_logical_bytes - 512)
    assert 0 <= over <= 131_072 and over % 512 == 0, profiled


# estimate / trace step peak: the trace - 512 B (the position ids, module docstring), == the real step, measured
# 0.99969 (fp32), 0.99948 (bf16); with the logits all-gathered (--no-loss-parallel) 0.99971 (before the trace's waits
# returned their input, trace/dtensor_handlers.py: 0.9560), its saved set 775,428 B (+ the full-vocabulary log-softmax)
PEAK_RATIO = {("fp32", True): (0.9995, 1.0), ("bf16", True): (0.999, 1.0), ("fp32", False): (0.9995, 1.0)}


@pytest.mark.slow  # the traces of the test above (cached), one more without loss_parallel (~55 s), the estimate
@pytest.mark.parametrize("precision,loss_parallel", list(PEAK_RATIO))
def test_estimate_equals_the_compiled_tp_trace(precision, loss_parallel):
    from trainmem.estimate import estimate
    from trainmem.specs.loaders import spec_from_hf_config

    traced, _ = _traced(precision, loss_parallel)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, BLOCK,
                       parallel=replace(TP_SP, loss_parallel=loss_parallel)).ranks
    led = _ledgers(traced.items)
    for ledger in ("parameter", "gradient", "optimizer_state", "buffer"):
        assert led[ledger] == rank.totals_bytes[ledger], ledger
    # the saved set autograd holds (saved_tensors_hooks) + the fp32 loss the caller holds
    assert traced.meta["compile"]["saved_compiled_bytes"] + 4 == rank.totals_bytes["activation"]
    lo, hi = PEAK_RATIO[precision, loss_parallel]
    assert lo <= rank.peak_bytes / traced.peak_logical_bytes <= hi
