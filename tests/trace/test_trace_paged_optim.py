"""bitsandbytes' paged optimizer states in the trace: kept out of the allocated and reserved figures
and reported as ``Category.PAGED_STATE``, as the estimate does, to the byte.

On CUDA ``Optimizer8bit.get_state_buffer`` (bitsandbytes/optim/optimizer.py) takes state1/state2 of
a parameter of 1e5 values or more from ``F.get_paged`` (``cudaMallocManaged``); on CPU it falls back
to plain tensors. The tracer runs the CUDA branch (trace/low_bit_optim.py). Tiny Llama and Qwen2
(h128, F345, V1000): the embedding and head (128000 values each) are paged, nothing else is. The real CPU step (bitsandbytes' own fallback, unpatched) holds the paged states as
plain tensors, so its peak is the trace's plus them.
"""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=345, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
QWEN2 = dict(LLAMA, model_type="qwen2", tie_word_embeddings=False)  # q/k/v biases
B, S = 1, 32
IMPL = ImplSpec(attention="sdpa", device="cpu")


def _by_name(items, category) -> dict[str, int]:
    return {i.name: i.bytes for i in items if i.category is category}


@pytest.mark.slow  # 8 cases of ~2 s; the default set runs the device-figure test below
@pytest.mark.parametrize("family,opt,precision", [
    (f, o, p) for f in ("llama", "qwen2") for o in ("paged-adamw8bit", "paged-adamw32bit") for p in ("fp32", "bf16")])
def test_paged_states_leave_the_traced_peak_as_in_the_estimate(family, opt, precision):
    cfg = {"llama": LLAMA, "qwen2": QWEN2}[family]
    step = StepSpec(batch=B, seq=S, precision=precision, optimizer=opt)
    t, e = trace_step(cfg, step, IMPL), estimate(spec_from_hf_config(cfg), step, IMPL)
    paged = _by_name(t.items, Category.PAGED_STATE)
    # state1 + state2 of the embedding and of the head (128000 values each), 1 or 4 bytes a value
    assert sum(paged.values()) == 2 * 2 * 128000 * (1 if opt == "paged-adamw8bit" else 4)
    assert paged == _by_name(e.inventory, Category.PAGED_STATE)  # every state, named alike, to the byte
    assert t.totals_at_peak_bytes["paged_optimizer_state"] == e.totals_bytes["paged_optimizer_state"]
    states = sum(i.bytes for i in t.items if i.category is Category.OPTIMIZER_STATE)
    assert states == e.totals_bytes["optimizer_state"]  # absmax, maps and small tensors stay device memory
    assert t.peak_logical_bytes == e.peak_bytes  # the peak without them, to the byte
    others = {k: v for k, v in t.totals_at_peak_bytes.items() if k != "paged_optimizer_state"}
    assert sum(others.values()) == t.peak_bytes  # the other ledgers still sum to the allocated peak


@pytest.mark.slow  # two traces and a real step, ~8 s
def test_non_paged_8bit_is_unchanged_and_paged_is_it_less_its_states():
    step8 = StepSpec(batch=B, seq=S, precision="fp32", optimizer="adamw8bit")
    plain = trace_step(LLAMA, step8, IMPL)
    paged = trace_step(LLAMA, StepSpec(batch=B, seq=S, precision="fp32", optimizer="paged-adamw8bit"), IMPL)
    assert plain.totals_at_peak_bytes["paged_optimizer_state"] == 0
    assert not [i for i in plain.items if i.category is Category.PAGED_STATE]
    moved = paged.totals_at_peak_bytes["paged_optimizer_state"]
    assert moved == 2 * 2 * 128000  # state1 + state2 (uint8) of embed_tokens and lm_head
    assert plain.peak_logical_bytes - paged.peak_logical_bytes == moved  # alive all step: the peak drops by them
    assert plain.peak_logical_bytes == estimate(spec_from_hf_config(LLAMA), step8, IMPL).peak_bytes


@pytest.mark.slow  # a real CPU step with bitsandbytes' own optimizer, ~4 s
def test_real_cpu_step_holds_them_as_plain_tensors():
    import bitsandbytes as bnb

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.live import LiveStorages

    step = StepSpec(batch=B, seq=S, precision="fp32", optimizer="paged-adamw8bit")
    t = trace_step(LLAMA, step, IMPL)
    torch.manual_seed(0)
    model = build_hf_model(LLAMA, attention="sdpa")
    model.train()
    opt = bnb.optim.PagedAdamW8bit(list(model.parameters()), lr=1e-4)  # unpatched: CPU falls back from paging
    ids = torch.randint(0, LLAMA["vocab_size"], (B, S))

    def one() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        one()  # the states exist from here on
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    with LiveStorages([*model.parameters(), *model.buffers(), ids, *states]) as live:
        one()
    assert live.peak == t.peak_logical_bytes + t.totals_at_peak_bytes["paged_optimizer_state"]


def test_device_figure_counts_the_same_resident_pages_in_trace_and_estimate():
    from trainmem.fitargs import estimate_fit
    from trainmem.trace.cli import trace_fit

    step = StepSpec(batch=B, seq=S, precision="bf16", optimizer="paged-adamw32bit")
    t, e = trace_step(LLAMA, step, IMPL), estimate(spec_from_hf_config(LLAMA), step, IMPL)
    args = argparse.Namespace(gpu="h100-80gb", gpu_memory=None, memory_figure="device", expandable_segments=False)
    traced, estimated = trace_fit(args, t)[0]["fits"], estimate_fit(args, e)[0]["fits"]
    assert _by_name(t.items, Category.PAGED_STATE) == _by_name(e.inventory, Category.PAGED_STATE)
    assert traced["paged_bytes"] == estimated["paged_bytes"] == 2 * 2 * 128000 * 4
    assert traced["paged_resident_bytes"] == estimated["paged_resident_bytes"] == traced["paged_bytes"]  # room on 80 GB
    # device = reserved + context + resident pages, in both (their reserved replays differ by the
    # input ids and 512-byte rounding, modelled elsewhere: tests/estimate/test_estimate_reserved.py)
    for fit in (traced, estimated):
        assert fit["need_bytes"] == fit["reserved_bytes"] + fit["context_bytes"] + fit["paged_bytes"]
    assert traced["reserved_bytes"] == t.peak_reserved_bytes
