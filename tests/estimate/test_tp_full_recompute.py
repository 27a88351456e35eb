"""``--tp 2 [--sp] --recompute full``: the first block's backward moment of a TP rank == the fake-PG trace's
(trace/parallel_tp.py), to the byte, once the rank takes its checkpointed blocks' node moments
(estimate/parallel_tp.py ``tp_node_moments``).

Both peak at the first block's MLP product backward (``mul`` in model.layers.0.mlp), where the down
projection's weight gradient already exists. Before, the generic block working set read under the trace on the
tiny Llama below (L4): fp32 -34,824 B (no sp, gathered logits), -51,208 B (sp + loss_parallel); bf16 sp -25,608 B.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402


def _llama(layers: int) -> dict:
    return dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                tie_word_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("precision,sp,layers,peak", [
    ("fp32", False, 4, 2_203_720),
    ("fp32", True, 4, 2_121_288),
    ("fp32", False, 2, 1_462_344),
    ("bf16", True, 4, 1_086_792),
    ("bf16", False, 2, 874_440),  # peak at the loss's backward (_log_softmax_backward_data), as before
])
def test_tp_full_recompute_peak_equals_trace(precision, sp, layers, peak):
    cfg = _llama(layers)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", recompute="full")
    par = ParallelSpec(tp=2, sp=sp, loss_parallel=sp)
    (rank,) = estimate(spec_from_hf_config(cfg), step, impl, par).ranks
    traced = trace_step(cfg, step, impl, parallel=par)
    assert traced.peak_logical_bytes == peak
    assert rank.peak_bytes == peak
