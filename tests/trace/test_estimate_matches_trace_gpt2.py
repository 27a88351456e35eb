"""Issue 15, item 8: `profile --compare` on CPU for a 2-layer GPT-2 at S=128 showed the estimate 8%
under the measurement, where the trace matched. On today's main the estimate's peak is the
trace's to within the tracer's 512-B rounding (fp32: 1,165,756,416 B against 1,165,758,464 B;
`profile --compare` on CPU: estimate, trace and measurement 1.09 GiB each, every ledger +0.0%).
This keeps it there: the trace runs the same CPU kernels the estimate models (``--device cpu``).
"""

import pytest

pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_config_dict, spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])  # ~3 s each
def test_two_layer_gpt2_s128_estimate_equals_trace(precision):
    config = {**load_config_dict("gpt2"), "n_layer": 2}
    step, impl = StepSpec(batch=1, seq=128, precision=precision), ImplSpec(device="cpu")
    est, traced = estimate(spec_from_hf_config(config), step, impl), trace_step(config, step, impl)
    assert abs(est.peak_bytes - traced.peak_bytes) <= 4096  # at most eight 512-B roundings apart
