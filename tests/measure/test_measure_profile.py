"""Profiles of tiny models on CPU: sane numbers, ledgers against the estimator, the Python API."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.measure import OutOfMemory, compare_table, profile, profile_model  # noqa: E402
from trainmem.measure.compare import compare_run  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

from measure_tiny import LLAMA, reference_spec  # noqa: E402

# tiny Llama: H=64, F=176, L=2, V=1000, no bias, untied: 2·64·1000 + 2·(4·64·64 + 3·64·176 + 2·64) + 64
NUM_PARAMS = 2 * 64 * 1000 + 2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64  # 228672


@pytest.fixture(scope="module")
def tiny_profile():
    return profile_model(LLAMA, StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec(attention="eager"),
                         device="cpu", steps=2, categories=True)


def test_profile_tiny_hf_model_is_sane(tiny_profile):
    r = tiny_profile
    d = r.to_dict()
    assert d["schema"] == "trainmem.profile/2" and d["device"] == "cpu"
    assert d["peak_reserved_bytes"] is None  # reserved n/a on CPU
    assert len(d["ranks"]) == 1 and d["ranks"][0]["rank"] == 0
    t = r.totals_bytes
    assert t["parameter"] == NUM_PARAMS * 4
    assert t["gradient"] == NUM_PARAMS * 4
    assert t["optimizer_state"] == 2 * NUM_PARAMS * 4  # AdamW exp_avg + exp_avg_sq (step counters are scalars)
    rank = r.ranks[0]
    assert rank.baseline_bytes >= t["parameter"] + t["optimizer_state"]
    assert r.peak_bytes > rank.baseline_bytes + t["activation"] // 2
    assert r.tokens_per_s > 0 and rank.step_time_s > 0
    assert len(rank.losses) >= 4 and all(5.0 < x < 8.0 for x in rank.losses)  # ≈ ln(1000) = 6.9 at init
    names = {m.name for m in rank.modules}
    assert "model.layers.0.self_attn" in names and "lm_head" in names
    assert all(m.backward_peak_bytes <= r.peak_bytes * 1.01 for m in rank.modules)
    cats = rank.categories_at_peak_bytes
    assert cats["parameter"] == t["parameter"] and cats["activation"] > 0


def test_profile_matches_estimator_on_cpu(tiny_profile):
    step, impl = StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec(attention="eager", device="cpu")
    e = estimate(spec_from_hf_config(LLAMA), step, impl)
    table = compare_table(e, None, tiny_profile)
    assert abs(table.row("activation").estimate_error_pct) < 2.0
    assert abs(table.row("peak_allocated").estimate_error_pct) < 2.0
    assert table.row("peak_reserved").measured_bytes is None
    # activations per tensor (tests/measure/test_measure_join.py): every key the same on both sides, the
    # loss itself included (the estimate's loss.value, (root):4B:0; nll_loss's total weight :1)
    assert [r.key for r in table.tensors if not r.equal] == []
    assert sum(r.equal for r in table.tensors) == len(table.tensors) > 30
    loss = next(r for r in table.tensors if r.key == "(root):4B:0")
    assert loss.items["estimate"].name == "loss.value" and loss.items["measured"].dtype == "float32"


def test_profile_reference_model_and_compare_run():
    spec = reference_spec(num_layers=1)
    impl = ImplSpec(profile="reference", attention="sdpa", device="cpu")
    table, measured = compare_run(spec, StepSpec(batch=1, seq=32, precision="fp32"), impl, device="cpu", steps=1,
                                  modules=False)
    assert measured.ranks[0].totals_bytes["activation"] > 0
    for name in ("parameter", "gradient", "optimizer_state"):
        assert table.row(name).estimate_error_pct == pytest.approx(0.0, abs=0.01)
    assert abs(table.row("peak_allocated").trace_error_pct) < 3.0
    assert set(table.to_dict()["rows"][0]) >= {"estimate_bytes", "trace_bytes", "measured_bytes", "estimate_error_pct"}


def test_profile_user_step_function():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = profile(step, model=model, optimizer=opt, tokens_per_step=16, device="cpu", steps=2, inputs=[x])
    params = (32 * 64 + 64 + 64 * 8 + 8) * 4  # 10784
    assert r.totals_bytes["parameter"] == params and r.totals_bytes["gradient"] == params
    # ReLU's output, saved by ReLU and the second Linear (16·64·4 = 4096), and for a user step function
    # the model's output, alive when the forward hook reads the counter (16·8·4 = 512)
    assert r.totals_bytes["activation"] == 4096 + 512
    assert r.peak_bytes >= params * 2 + x.numel() * 4
    assert [m.name for m in r.ranks[0].modules] == ["0", "1", "2"]
    # the same activations per tensor, keyed <module>:<bytes>B:<k>; x is the caller's, saved by the first Linear
    assert [(i.key, i.name) for i in r.ranks[0].items] == [
        ("1:4096B:0", "1.relu"), ("2:512B:0", "2.addmm"), (f"(inputs):{x.numel() * 4}B:0", "(inputs).input")]


def test_allocation_failure_is_out_of_memory():
    def step():
        torch.empty(1 << 60, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory

    with pytest.raises(OutOfMemory, match="out of memory"):
        profile(step, device="cpu", steps=1, warmup=0)


def test_snapshot_needs_cuda():
    from trainmem.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="CUDA"):
        profile(lambda: None, device="cpu", snapshot="x.pickle", warmup=0)
