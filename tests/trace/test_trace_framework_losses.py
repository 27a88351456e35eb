"""The tracer's torchtune and LitGPT chunked losses (trainmem/trace/losses.py): against torchtune's
own ``CEWithChunkedOutputLoss`` on CPU, and fake tensors against a real CPU step.

torchtune 0.6.1's package ``__init__`` imports torchao modules this torchao (0.18) no longer has,
so its loss module is loaded from the installed file by path (it imports only torch); skipped
where torchtune is not installed (requirements-dev.txt: ``pip install --no-deps torchtune==0.6.1``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step
from trainmem.trace.live import LiveStorages
from trainmem.trace.losses import framework_loss

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def _torchtune_loss_class():
    spec = importlib.util.find_spec("torchtune")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "modules" / "loss" / "ce_chunked_output_loss.py"
    mod_spec = importlib.util.spec_from_file_location("_tt_ce_chunked_output_loss", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.CEWithChunkedOutputLoss


@pytest.mark.parametrize("B", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_torchtune_loss_matches_torchtunes_own_class(B):
    """Same value, same peak of live storages and same bytes kept for backward, given the same
    model: trainmem's path vs the recipe's ``_loss_step`` calling torchtune's class."""
    CE = _torchtune_loss_class()
    torch.manual_seed(0)
    model = build_hf_model(CFG, attention="sdpa", dtype=torch.bfloat16)
    S = 64
    ids = torch.randint(0, CFG["vocab_size"], (B, S))
    ignore = torch.full((B, 1), -100, dtype=ids.dtype)
    head, decoder = model.get_output_embeddings(), model.base_model

    def theirs():
        logits = [head(c) for c in decoder(input_ids=ids).last_hidden_state.chunk(8, dim=1)]  # chunked_output
        labels = torch.hstack((ids[..., 1:], ignore[:B]))  # _loss_step
        loss = CE(num_output_chunks=8)(logits, labels)
        del logits
        return loss

    def ours():
        return framework_loss("torchtune-chunked-ce", model, ids, ignore_labels=ignore)

    results = []
    for run in (theirs, ours):
        base = [*model.parameters(), *model.buffers(), ids, ignore]
        with LiveStorages(base) as live:
            loss = run()
            kept = live.now
        results.append((loss.item(), live.peak, kept))
        del loss
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    assert results[0][1:] == results[1][1:]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["torchtune-chunked-ce", "litgpt-chunked-ce"])
@pytest.mark.parametrize("precision,B", [("fp32", 2), ("bf16", 1)])
def test_fake_trace_equals_real_step(loss, precision, B):
    step = StepSpec(batch=B, seq=200, precision=precision, loss=loss)
    impl = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="fused")
    fake = trace_step(CFG, step, impl)
    real = trace_step(CFG, step, impl, real=True)
    assert fake.meta["fake"] and not real.meta["fake"]
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes


@pytest.mark.slow
def test_chunked_losses_are_lower_than_hf_ce_in_bf16():
    # B=2, S=128, V=1000: HF's bf16 logits, their fp32 copy and log-softmax, then two fp32 gradients;
    # torchtune keeps fp32 log-softmax but upcasts one chunk; LitGPT's one 128-token chunk keeps bf16
    impl = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="fused")
    peaks = {loss: trace_step(CFG, StepSpec(batch=2, seq=128, precision="bf16", loss=loss), impl).peak_bytes
             for loss in ("ce", "torchtune-chunked-ce", "litgpt-chunked-ce")}
    assert max(peaks["torchtune-chunked-ce"], peaks["litgpt-chunked-ce"]) < peaks["ce"], peaks


@pytest.mark.parametrize("loss,impl,match", [
    ("chunked-ce", ImplSpec(), "is not traced"),
    ("torchtune-chunked-ce", ImplSpec(compile=True), "compile_scope='model' is not traced"),
])
def test_untraceable_losses_are_refused(loss, impl, match):
    with pytest.raises(UnsupportedError, match=match):
        trace_step(CFG, StepSpec(batch=1, seq=16, loss=loss), impl)


@pytest.mark.slow
def test_compiled_chunk_loss_keeps_row_statistics_not_log_softmax():
    """torchtune's compile_loss (compile_scope='block-loss') compiles compute_cross_entropy alone:
    each chunk keeps its bf16 logits, labels, row max and log-sum-exp ((rows, 1) fp32), not the
    fp32 log-softmax the eager loss keeps (the estimate refuses this combination: not modelled)."""
    step = StepSpec(batch=2, seq=200, precision="bf16", loss="torchtune-chunked-ce")
    eager = trace_step(CFG, step, ImplSpec(attention="sdpa", device="cpu"))
    compiled = trace_step(CFG, step, ImplSpec(attention="sdpa", device="cpu", compile=True, compile_scope="block-loss"))
    names = [t.name for t in compiled.alive_at_peak]
    assert not any("_log_softmax" in n for n in names)
    stats = [t for t in compiled.alive_at_peak if t.name.split(":")[0] in ("GraphModule.amax", "GraphModule.log")]
    assert len(stats) == 16 and {tuple(t.shape) for t in stats} == {(50, 1)}  # 8 chunks × (max, lse), 2·25 rows
    assert compiled.peak_bytes < eager.peak_bytes
