"""``recompute='op'``: op-level selective activation checkpointing with torchtitan's policy.

Checked against the real mechanism (``torch.utils.checkpoint`` + ``create_selective_checkpoint_contexts``
on real CPU tensors, transformers models built from config): what the forward keeps equals the
estimate to the byte; the fake-tensor trace equals the real-tensor trace to the byte; the estimated
step peak is within 1% of the real step's live-storage peak.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.graph import OpPolicy
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.live import LiveStorages
from trainmem.trace.saved import step_peak_bytes
from trainmem.trace.recompute import op_sac_context
from trainmem.trace.storages import storage_key

B, S = 2, 64
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)
FAMILIES = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128),  # addmm
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),  # q/k/v with bias: addmm, not counted as mm
    "mistral": dict(model_type="mistral", **SMALL),
}


def _op_model(cfg: dict, attention: str, precision: str):
    torch.manual_seed(0)
    model = build_hf_model(cfg, attention=attention, dtype=torch.bfloat16 if precision == "bf16" else None)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": op_sac_context})
    return model


def _kept_by_forward(cfg: dict, precision: str, attention: str) -> int:
    """Bytes of the storages the forward leaves alive (the loss included), plus the input ids,
    which the embedding keeps but which were made outside: counted once whether or not an op
    (GPT-2's ``input_ids.view``) hands them out again."""
    model = _op_model(cfg, attention, precision)
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with LiveStorages(skip_keys=skip) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16"):
            loss = model(ids, labels=ids).loss
    assert loss.untyped_storage().nbytes() == 4  # the fp32 loss the caller holds: the estimate's loss.value
    return live.now + ids.untyped_storage().nbytes()


def test_policy_keeps_odd_mms_and_every_addmm_bmm_and_cuda_sdpa():
    p = OpPolicy()
    # a Llama block: q, k, v, o, gate, up, down -> the 1st, 3rd, 5th and 7th mm are kept
    assert [p.save("mm") for _ in range(7)] == [True, False, True, False, True, False, True]
    assert p.save("addmm") and p.save("bmm") and p.save("sdpa_flash") and p.save("sdpa_efficient")
    assert not p.save("sdpa_flash_cpu")  # _scaled_dot_product_flash_attention_for_cpu is not on the list
    assert p.save("mm") is False  # addmm/bmm did not move the count: this is the 8th mm


def test_torch_policy_keeps_the_same_outputs():
    """The trace's policy under the real torch mechanism: four mm's and one addmm in one
    checkpointed function keep the inputs plus the 1st and 3rd mm outputs and the addmm output."""
    w = torch.randn(16, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)

    def f(x):
        for _ in range(4):
            x = torch.mm(x, w).relu()  # relu: every mm output is a fresh storage the next op reads
        return torch.addmm(b, x, w).relu()

    x = torch.randn(8, 16, requires_grad=True)
    with LiveStorages(skip_keys=[storage_key(t) for t in (w, b, x)]) as live:
        out = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False, context_fn=op_sac_context)
    # kept: mm #1, mm #3, addmm, each 8·16·4 = 512 bytes; plus the output itself (512)
    assert live.now - out.untyped_storage().nbytes() == 3 * 512


def test_llama_fp32_keeps_exact_bytes():
    items = {i.name: i.bytes for i in activation_items(
        spec_from_hf_config(FAMILIES["llama"]), StepSpec(batch=B, seq=S, precision="fp32"),
        ImplSpec(attention="sdpa", recompute="op", device="cpu"))}
    # B·S·A·hd·4 = 2·64·64·4 = 32768 (q_proj, 1st mm); B·S·Akv·hd·4 = 2·64·32·4 = 16384 (v_proj, 3rd);
    # B·S·F·4 = 2·64·176·4 = 90112 (gate_proj, 5th); B·S·H·4 = 32768 (down_proj, 7th)
    assert items["model.layers.0.self_attn.q_proj.out"] == 32768
    assert items["model.layers.0.self_attn.v_proj.out"] == 16384
    assert items["model.layers.0.mlp.gate_proj.out"] == 90112
    assert items["model.layers.0.mlp.down_proj.out"] == 32768
    assert "model.layers.0.self_attn.k_proj.out" not in items and "model.layers.0.mlp.up_proj.out" not in items


CASES = [(f, p, a) for f in FAMILIES for p in ("fp32", "bf16", "amp-bf16") for a in ("eager", "sdpa")]


@pytest.mark.parametrize("family,precision,attention", CASES)
def test_activations_equal_real_op_checkpointing(family, precision, attention):
    cfg = FAMILIES[family]
    measured = _kept_by_forward(cfg, precision, attention)
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention=attention, recompute="op", device="cpu"))
    assert sum(i.bytes for i in items) == measured


LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=500)


@pytest.mark.slow  # 10-30 s on 2 shared cores: the default run is at its 10-minute budget
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trace_on_fake_tensors_equals_real(precision):
    # eager: with SDPA, transformers materializes the causal mask on fake tensors only (it cannot
    # read their values to skip it), which full checkpointing shows as well
    step = StepSpec(batch=2, seq=128, precision=precision)
    impl = ImplSpec(attention="eager", recompute="op", device="cpu")
    fake, real = trace_step(LLAMA, step, impl), trace_step(LLAMA, step, impl, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes


@pytest.mark.slow  # ~4-6 s a case
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_peak_within_one_percent(precision):
    step = StepSpec(batch=2, seq=256, precision=precision)
    model = _op_model(LLAMA, "sdpa", precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 256))

    def one_step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # the optimizer state exists from here on
    measured = step_peak_bytes(model, opt, one_step)
    est = estimate(spec_from_hf_config(LLAMA), step,
                   ImplSpec(attention="sdpa", recompute="op", device="cpu", optimizer_impl="foreach"))
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured, est.peak_phase)


def test_op_sits_between_full_and_none():
    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=256, precision="bf16")
    acts = {r: sum(i.bytes for i in activation_items(spec, step, ImplSpec(recompute=r))) for r in ("none", "op", "full")}
    assert acts["full"] < acts["op"] < acts["none"]


def test_op_is_refused_where_not_modelled():
    with pytest.raises(SpecError, match="recompute"):
        ImplSpec(recompute="op", profile="reference")
    with pytest.raises(SpecError, match="recompute_every"):
        ImplSpec(recompute="op", recompute_every=2)


def test_cost_recomputes_the_even_mms():
    from trainmem.plan.cost import op_recomputed_parameters, step_time
    from trainmem.plan.hardware import GPU
    from trainmem.specs import ParallelSpec
    from trainmem.specs.loaders import load_model

    m = load_model("llama-3-8b")
    # Llama's mm's in order q, k, v, o, gate, up, down: k, o and up run again:
    # 1024·4096 + 4096·4096 + 14336·4096 = 4194304 + 16777216 + 58720256 = 79691776
    assert op_recomputed_parameters(m) == 79691776
    qwen = spec_from_hf_config(FAMILIES["qwen2"])
    # q/k/v have biases (addmm, kept): the mm's are o, gate, up, down and gate, down run again: 2·176·64
    assert op_recomputed_parameters(qwen) == 2 * 176 * 64
    gpu = GPU(name="x", memory_bytes=1 << 36, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
              inter_node_bytes_per_s=1e10, host_bytes_per_s=1e10, gpus_per_node=8)
    step = StepSpec(batch=1, seq=4096, precision="bf16")
    t = {r: step_time(m, step, ImplSpec(recompute=r), ParallelSpec(), gpu, global_batch=4).compute_s
         for r in ("none", "op", "full")}
    assert t["none"] < t["op"] < t["full"]
