"""bitsandbytes' 8-bit and paged optimizers and torchao's 8-bit/4-bit AdamW: the estimate's state
layouts as exact integers, then against the real optimizers' ``optimizer.state`` on CPU.

A tiny Llama built from config (h128, 2 layers, F345, V1000). Its tensors straddle every threshold:
norms (128 values) under ``min_8bit_size`` (4096); the embedding and head (128000) over paged
buffers' 1e5; gate/up/down (345·128 = 44160) not a multiple of torchao's 8-bit block (256: it keeps
them unquantized) but of its 4-bit block (128), and bitsandbytes' last block partial (⌈44160/256⌉ = 173).

bitsandbytes 0.50.2 runs these optimizers on CPU (its ``default`` backend) and on fake tensors (fake
kernels in ``bitsandbytes/_ops.py``); paging falls back to plain tensors on CPU, so the real states
equal the estimate's optimizer and paged states together (the tracer pages as on CUDA:
tests/trace/test_trace_paged_optim.py). torchao 0.18's state tensors are made in
``step()`` before its ``torch.compile``'d update, which runs eagerly here
(``torch.compiler.set_stance("force_eager")``) to skip inductor's C++ build: the states are made
by the same code either way.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.model_states import model_state_items, optimizer_step_transient_bytes
from trainmem.estimate.state_items import optimizer_state_items
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=345, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
MODEL = spec_from_hf_config(CFG)
B, S = 1, 32
BNB = ("adam8bit", "adamw8bit", "paged-adamw8bit", "paged-adamw32bit")
TORCHAO = ("torchao-adamw8bit", "torchao-adamw4bit")
STATES = (Category.OPTIMIZER_STATE, Category.PAGED_STATE)


def _bytes(opt, shape, precision="fp32"):
    items = optimizer_state_items("w", shape, StepSpec(optimizer=opt, precision=precision))
    return sum(i.bytes for i in items), sum(i.bytes for i in items if i.category is Category.PAGED_STATE)


# layouts, as exact integers -----------------------------------------------------------------------

@pytest.mark.parametrize("opt,shape,total,paged", [
    ("adamw8bit", (4095,), 2 * 4095 * 4, 0),                     # under min_8bit_size: two fp32 states
    ("adamw8bit", (4096,), 2 * 4096 + 2 * 16 * 4, 0),            # uint8 states + 16 fp32 absmax each
    ("adamw8bit", (44160,), 2 * 44160 + 2 * 173 * 4, 0),         # ⌈44160/256⌉ = 173 blocks
    ("adam8bit", (44160,), 2 * 44160 + 2 * 173 * 4, 0),          # Adam8bit: the same layout
    ("paged-adamw8bit", (99999,), 2 * 99999 + 2 * 391 * 4, 0),   # under 1e5: plain device tensors
    ("paged-adamw8bit", (100000,), 2 * 100000 + 2 * 391 * 4, 2 * 100000),  # uint8 states paged, absmax not
    ("paged-adamw32bit", (100000,), 2 * 100000 * 4, 2 * 100000 * 4),
    ("paged-adamw32bit", (4095,), 2 * 4095 * 4, 0),
    ("torchao-adamw8bit", (4096,), 2 * (4096 + 16 * 4 + 256 * 4), 0),  # codes + scales + own 256-entry qmap
    ("torchao-adamw8bit", (44160,), 2 * 44160 * 4, 0),           # 44160 % 256 != 0: fp32 zeros_like
    ("torchao-adamw4bit", (44160,), 2 * (44160 // 2 + 345 * 4 + 16 * 4), 0),  # two codes a byte, 16-entry qmap
    ("torchao-adamw4bit", (4000,), 2 * 4000 * 4, 0),             # under 4096
])
def test_state_layout_bytes(opt, shape, total, paged):
    assert _bytes(opt, shape) == (total, paged)


def test_states_follow_the_parameter_dtype_only_in_torchao():
    assert _bytes("torchao-adamw8bit", (100,), "bf16")[0] == 2 * 100 * 2  # torch.zeros_like(p)
    assert _bytes("adamw8bit", (100,), "bf16")[0] == 2 * 100 * 4        # bitsandbytes: fp32 always


def test_paged_state_is_its_own_figure_not_in_the_peak():
    step = StepSpec(batch=B, seq=S, precision="bf16", optimizer="paged-adamw8bit")
    paged, plain = estimate(MODEL, step), estimate(MODEL, StepSpec(batch=B, seq=S, precision="bf16",
                                                                    optimizer="adamw8bit"))
    # embed_tokens and lm_head (128000 values each) page their two uint8 states: 4 · 128000
    assert paged.totals_bytes["paged_optimizer_state"] == 4 * 128000
    assert paged.totals_bytes["optimizer_state"] + 4 * 128000 == plain.totals_bytes["optimizer_state"]
    for a, b in zip(paged.phases, plain.phases):
        assert a.bytes + 4 * 128000 == b.bytes
        assert "paged_optimizer_state" not in a.parts


def test_bitsandbytes_maps_are_counted_once():
    items = model_state_items(MODEL, StepSpec(optimizer="adamw8bit"))
    maps = [i for i in items if i.name.startswith("optimizer.qmap")]
    assert [(i.name, i.bytes) for i in maps] == [("optimizer.qmap1", 1024), ("optimizer.qmap2", 1024)]


@pytest.mark.parametrize("opt,per_numel", [("torchao-adamw8bit", 8), ("torchao-adamw4bit", 26)])
def test_torchao_step_buffers_of_the_largest_quantized_tensor(opt, per_numel):
    # embed / lm_head, 128000 values: 8-bit 2 fp32 copies + 2·500 scales; 4-bit adds 2 unpacked uint8
    # codes and 2 int64 lookups per value, 2·1000 scales
    block = 256 if opt.endswith("8bit") else 128
    nbytes, rule = optimizer_step_transient_bytes(MODEL, StepSpec(optimizer=opt, precision="fp32"), ImplSpec())
    assert nbytes == 128000 * per_numel + 2 * (128000 // block) * 4, rule


@pytest.mark.parametrize("opt", BNB)
def test_bitsandbytes_step_keeps_no_temporaries(opt):
    assert optimizer_step_transient_bytes(MODEL, StepSpec(optimizer=opt), ImplSpec())[0] == 0


# against the real optimizers --------------------------------------------------------------------

def _storage_bytes(t) -> dict[int, int]:
    """Storage pointer -> bytes of a tensor, or of each inner tensor of a wrapper subclass (torchao's)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_traceable_wrapper_subclass(t):
        out: dict[int, int] = {}
        for attr in t.__tensor_flatten__()[0]:
            out.update(_storage_bytes(getattr(t, attr)))
        return out
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()}


def _real_states(opt_name: str, precision: str) -> tuple[dict[str, int], int]:
    """(bytes per parameter name excluding shared storages and step counters, all distinct bytes)."""
    torch = pytest.importorskip("torch")
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.optimizers import make_optimizer_for
    from trainmem.trace.torch_state import default_dtype
    if opt_name in TORCHAO:
        pytest.importorskip("torchao")
        import torchao.optim as ao
        step = StepSpec(optimizer=opt_name, precision=precision)
        with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):
            model = build_hf_model(CFG, attention="sdpa")
        cls = ao.AdamW8bit if opt_name.endswith("8bit") else ao.AdamW4bit
        opt = cls(list(model.parameters()), lr=1e-4)
        ctx = torch.compiler.set_stance("force_eager")  # torch's own switch: compiled functions run eagerly
    else:
        pytest.importorskip("bitsandbytes")
        step = StepSpec(optimizer=opt_name, precision=precision)
        with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):
            model = build_hf_model(CFG, attention="sdpa")
        _, _, opt = make_optimizer_for(model, step, ImplSpec(device="cpu"))
        import contextlib
        ctx = contextlib.nullcontext()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    with ctx:
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, set[str]] = {}
    per_param: dict[str, dict[int, int]] = {}
    for p, state in opt.state.items():
        mine = per_param.setdefault(names[id(p)], {})
        for k, v in state.items():
            if k == "step" or not isinstance(v, torch.Tensor):  # torchao: a 0-dim CPU tensor (host memory on CUDA)
                continue
            for ptr, n in _storage_bytes(v).items():
                mine[ptr] = n
                owners.setdefault(ptr, set()).add(names[id(p)])
    distinct = {ptr: n for d in per_param.values() for ptr, n in d.items()}
    own = {name: sum(n for ptr, n in d.items() if len(owners[ptr]) == 1) for name, d in per_param.items()}
    return own, sum(distinct.values())


_FAST = {("adamw8bit", "fp32"), ("paged-adamw8bit", "bf16"), ("torchao-adamw8bit", "fp32"),
         ("torchao-adamw4bit", "bf16")}


@pytest.mark.parametrize("opt,precision", [
    pytest.param(o, p, marks=() if (o, p) in _FAST else pytest.mark.slow)
    for o in BNB + TORCHAO for p in ("fp32", "bf16")])
def test_state_bytes_equal_the_real_optimizer(opt, precision):
    real, real_total = _real_states(opt, precision)
    items = [i for i in model_state_items(MODEL, StepSpec(optimizer=opt, precision=precision))
             if i.category in STATES]
    est = {}
    for i in items:
        owner = next((n for n in real if i.name.startswith(n + ".")), None)
        if owner is not None:
            est[owner] = est.get(owner, 0) + i.bytes
    assert est == real  # every parameter, to the byte
    assert sum(i.bytes for i in items) == real_total  # with bitsandbytes' two shared maps, once


@pytest.mark.parametrize("opt", [pytest.param("adamw8bit", marks=pytest.mark.slow), "paged-adamw8bit"])
def test_trace_runs_bitsandbytes_on_fake_tensors(opt):
    pytest.importorskip("bitsandbytes")
    from trainmem.trace import trace_step
    step, impl = StepSpec(batch=B, seq=S, precision="fp32", optimizer=opt), ImplSpec(attention="sdpa", device="cpu")
    t, e = trace_step(CFG, step, impl), estimate(MODEL, step, impl)
    traced = sum(i.bytes for i in t.items if i.category is Category.OPTIMIZER_STATE)
    # the fake kernel allocates nothing, as the CUDA kernel; the tracer pages as bitsandbytes does on
    # CUDA (trace/low_bit_optim.py), so paged states are their own ledger in both
    assert traced == e.totals_bytes["optimizer_state"]
    assert t.totals_at_peak_bytes["paged_optimizer_state"] == e.totals_bytes.get("paged_optimizer_state", 0)
    # the step's peak is in backward, modelled elsewhere (tests/estimate/test_groundtruth_hf.py): within 0.5%
    extra = sum(i.bytes for i in t.items if i.category is Category.INPUT)  # the buffers are in both
    assert abs(e.peak_bytes + extra - t.peak_logical_bytes) <= 0.005 * t.peak_logical_bytes


# what the integrations read off a live optimizer -------------------------------------------------

def test_live_optimizers_are_read_by_what_they_run():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    ao = pytest.importorskip("torchao.optim")
    from trainmem.integrations.read import optimizer_of
    p = [torch.nn.Parameter(torch.zeros(8))]
    built = {  # transformers builds bnb.optim.AdamW(optim_bits=..., is_paged=...) (_get_bitsandbytes_optimizer)
        "adamw8bit": bnb.optim.AdamW(p, optim_bits=8),
        "paged-adamw8bit": bnb.optim.AdamW(p, optim_bits=8, is_paged=True),
        "paged-adamw32bit": bnb.optim.PagedAdamW(p), "adam8bit": bnb.optim.Adam8bit(p),
        "torchao-adamw8bit": ao.AdamW8bit(p), "torchao-adamw4bit": ao.AdamW4bit(p),
    }
    for name, opt in built.items():
        assert optimizer_of(opt, device="cuda").value == (name, "auto"), type(opt)


# plan / advise -----------------------------------------------------------------------------------

def test_advise_offers_the_low_bit_optimizers():
    from trainmem.plan.choices import CHOICES, Config, Context
    from trainmem.specs import ParallelSpec
    start = Config(StepSpec(optimizer="adamw"), ImplSpec(), ParallelSpec())
    got = [v.step.optimizer for v, _ in CHOICES["optimizer_8bit"].variants(start, Context(MODEL, 1, 8))]
    assert got == ["adamw8bit", "paged-adamw8bit", "torchao-adamw8bit", "torchao-adamw4bit"]


@pytest.mark.parametrize("opt,per_param", [("paged-adamw8bit", 2), ("paged-adamw32bit", 8), ("adamw8bit", 0)])
def test_paged_states_are_priced_out_and_back_over_pcie(opt, per_param):
    from trainmem.plan.cost import matmul_parameters, step_time
    from trainmem.plan.hardware import GPU
    from trainmem.specs import ParallelSpec
    gpu = GPU(name="x", memory_bytes=1 << 36, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
              inter_node_bytes_per_s=1e10, host_bytes_per_s=1e10)
    t = step_time(MODEL, StepSpec(batch=1, seq=S, optimizer=opt), ImplSpec(), ParallelSpec(), gpu, global_batch=1)
    n = matmul_parameters(MODEL)[1]  # every parameter trains
    assert t.offload_s == 2 * n * per_param / 1e10


def test_explain_counts_paged_bytes_per_parameter():
    from trainmem.plan.explain import mixed_precision
    step = StepSpec(batch=B, seq=S, optimizer="paged-adamw8bit")
    a = mixed_precision(MODEL, step, estimate(MODEL, step))
    # embed_tokens and lm_head page their uint8 states: 4 · 128000 bytes over every parameter
    n = a.numbers["parameters"]
    assert a.numbers["bytes_per_parameter"]["paged_optimizer_state"] == 4 * 128000 / n
    assert "paged optimizer state" in a.answer and "docs/optimizers.md" in a.answer


def test_precision_line_names_the_low_bit_states():
    assert StepSpec(optimizer="adamw").precision_description.count("bf16 optimizer states") == 1
    line = StepSpec(optimizer="paged-adamw8bit", precision="mixed-bf16").precision_description
    assert "paged 8-bit blockwise optimizer states (paged-adamw8bit)" in line and "fp32 master" in line
