"""trace --optimizer torchao-adamw8bit|torchao-adamw4bit: torchao's optimizer and its compiled step
on fake tensors (trace/torchao_optim.py), against the estimate and a real CPU step.

- Fake trace of a tiny Llama (bf16, full fine-tuning): parameters, gradients and optimizer states
  (torchao's OptimState8bit/4bit flattened to codes, scale and qmap, named as the estimate's items)
  equal the estimate to the byte; the optimizer phase, where inductor's generated wrapper allocates
  its buffers, equals the estimate's optimizer phase (estimate/optimizer_step.py ``_torchao_rule``)
  plus the input ids the trace holds and no estimate counts, to the byte; so does the step's peak.
- Fake == real: LoRA r=32 on q/v (each adapter 4,096 values, so torchao quantizes its states), the
  real step compiles and runs inductor's C++ kernels.
Slow: every distinct parameter shape compiles once (~40 s a fake trace on two loaded cores; the real
one also compiles C++).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchao")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)
STATES = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE)


def _optimizer_peak(result) -> int:
    """Most logical bytes alive while ``optimizer.step()`` runs (the recording's optimizer phase)."""
    rec = result.recording
    starts = {i: name for i, name in rec.marks}  # event index -> the phase that starts there
    live = top = 0
    phase = None
    for i, e in enumerate(rec.events):
        phase = starts.get(i, phase)
        live += rec.blocks[e].nbytes if e >= 0 else -rec.blocks[~e].nbytes
        if phase == "optimizer":
            top = max(top, live)
    return top


def _items(items, category):
    return {i.name: i.bytes for i in items if i.category == category}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["torchao-adamw8bit", "torchao-adamw4bit"])
def test_traced_states_and_compiled_step_equal_the_estimate(optimizer):
    step, impl = StepSpec(batch=2, seq=32, precision="bf16", optimizer=optimizer), ImplSpec(attention="eager")
    traced = trace_step(CFG, step, impl)
    est = estimate(spec_from_hf_config(CFG), step, ImplSpec(attention="eager", device="cpu"))
    for category in STATES:
        assert _items(traced.items, category) == _items(est.inventory.items, category), category
    ids = sum(i.bytes for i in traced.items if i.category == Category.INPUT)  # 2·32·8 = 512
    est_opt = next(p for p in est.phases if p.name == "optimizer")
    assert est_opt.parts["caller_ids"] == ids  # the caller's batch, held through optimizer.step() in both
    assert _optimizer_peak(traced) == est_opt.bytes, est_opt.note
    assert est.peak_phase == "optimizer" and traced.peak_logical_bytes == est.peak_bytes


@pytest.mark.slow
def test_fake_trace_equals_a_real_compiled_step():
    step = StepSpec(batch=2, seq=32, precision="bf16", optimizer="torchao-adamw8bit")
    impl, ft = ImplSpec(attention="eager"), FinetuneSpec(mode="lora", lora_rank=32)
    fake = trace_step(CFG, step, impl, finetune=ft)
    real = trace_step(CFG, step, impl, finetune=ft, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert _optimizer_peak(fake) == _optimizer_peak(real)
    # the adapters' states are quantized: codes, scales and maps, not bf16 zeros_like
    assert any(n.endswith(".exp_avg.codes") for n in _items(fake.items, Category.OPTIMIZER_STATE))
