"""The whole-step peak of a classification model (``--head seq-cls|token-cls``): estimate == trace to the byte,
and the trace == a real CPU step (less the optimizer's host step counters, which the trace does not see).

A tiny untied Llama (h64, 2 layers, V256; B1, S64; AdamW for-loop, CPU kernels), built by transformers'
``AutoModelFor{Sequence,Token}Classification`` from the config. The peak is the final RMSNorm's backward (bf16) or
the last block's MLP product backward (fp32). At that moment the token embedding's gradient does not exist yet:
a classifier is never tied to it, so it comes last (estimate/peak.py ``layer_stats``); the pooling indices and the
token classifier's dropout were freed by the head's backward (``families/base.py`` ``task_head_parts``: head
modules); the labels are the caller's, the loss's target a view of them, alive through the step.
Before these fixes the estimate was over by 32,776 (seq-cls) / 48,640 (token-cls) bytes in bf16.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, num_labels=3)
B, S = 1, 64
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def _spec(head):
    return replace(spec_from_hf_config(CFG), head=head, num_labels=CFG["num_labels"])


def _real_step(head: str, step: StepSpec) -> tuple[int, int, int]:
    """(peak of the second step, bytes of the optimizer's step counters, parameter count) of a real CPU step."""
    from tests.estimate.real_head_step import real_head_step

    return real_head_step(CFG, head, step, IMPL)


@pytest.mark.parametrize("head", ["seq-cls", "token-cls"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_head_peak_estimate_equals_trace(head, precision):
    step = StepSpec(batch=B, seq=S, precision=precision)
    est = estimate(_spec(head), step, IMPL)
    t = trace_step(CFG, step, IMPL, head=head)
    assert est.peak_bytes == t.peak_logical_bytes, (est.peak_bytes, t.peak_logical_bytes, est.peak_phase)
    assert est.peak_phase == t.peak_phase == "backward"
    # the embedding's gradient is not in the backward peak: the head's (classifier, final norm) are
    grads = next(p for p in est.phases if p.name == "backward").parts["gradients"]
    assert grads < CFG["vocab_size"] * CFG["hidden_size"] * (2 if precision == "bf16" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["seq-cls", "token-cls"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_head_peak_trace_equals_real_step(head, precision):
    step = StepSpec(batch=B, seq=S, precision=precision)
    t = trace_step(CFG, step, IMPL, head=head)
    real, steps, n_params = _real_step(head, step)
    assert steps == 4 * n_params  # one fp32 0-dim counter per parameter
    assert real == t.peak_logical_bytes + steps, (real, t.peak_logical_bytes, steps)
