"""``--profile traced --tp N`` (estimate/traced/tp.py): the cut model traced at one TP rank's
shapes, the blocks cut by transformers' ``base_model_tp_plan``.

* The styles' cuts, the block-index wildcard and the state divisors (fast, no model build).
* Refusals: every layout but ``--tp`` alone, in one line naming the field (fast: before any trace).
* Against the hand-written hf rules (slow): llama, qwen2, mistral (also a 16-token window past
  it) × fp32/bf16 × eager/sdpa, tp = 2; with sequence parallelism, gathered logits, tp = 4 and
  --recompute full: every ledger, every phase and the peak equal, to the byte.
* Against a real tp = 2 run (tests/parallel/test_traced_tp_dist.py, torchrun, slow): granite.
"""

from __future__ import annotations

import json

import pytest

from trainmem.errors import SpecError
from trainmem.estimate.traced.tp import STYLES, VOCAB, _divisor, _local_shape, _wildcard

B, S = 2, 32
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)


def test_styles_cut_as_transformers_shards():
    # ColwiseParallel.shard_param: Shard(0) for weight and bias; RowwiseParallel: weight Shard(-1), bias Replicate
    assert _local_shape((176, 64), STYLES["colwise"], 2, False, "w") == (88, 64)
    assert _local_shape((176,), STYLES["colwise_gather_output"], 2, True, "b") == (88,)
    assert _local_shape((64, 176), STYLES["rowwise"], 2, False, "w") == (64, 88)
    assert _local_shape((64,), STYLES["rowwise_split_input"], 2, True, "b") == (64,)
    assert _local_shape((16,), STYLES["replicated_with_grad_allreduce"], 4, False, "w") == (16,)
    assert _local_shape((501, 64), VOCAB, 2, False, "emb") == (251, 64)  # ⌈V/tp⌉ rows
    with pytest.raises(SpecError, match="tp=4: must divide q.weight's output features"):
        _local_shape((66, 64), STYLES["colwise"], 4, False, "q.weight")


def test_wildcard_and_divisors_by_parameter():
    assert _wildcard("model.layers.12.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert _wildcard("model.layers.3") == "model.layers.*"
    assert _wildcard("model.w1.proj") == "model.w1.proj"
    div = {"model.layers.0.mlp.up_proj.weight": 2}
    assert _divisor("model.layers.0.mlp.up_proj.weight.exp_avg_sq", div) == 2
    assert _divisor("model.layers.0.mlp.up_proj.weight", div) == 2
    assert _divisor("model.layers.0.input_layernorm.weight.grad", div) == 1


def _model(tmp_path, cfg):
    from trainmem.specs.loaders import load_model
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_model(str(path))


@pytest.mark.parametrize("layout, field", [
    (dict(tp=2, pp=2), "pp"), (dict(tp=2, dp=2), "dp"), (dict(tp=2, cp=2), "cp"), (dict(dp=2), "profile"),
    (dict(tp=2, zero=1, dp=2), "dp"),
])
def test_refusals_name_the_field(tmp_path, layout, field):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
    with pytest.raises(SpecError, match=f"^{field}="):
        estimate(_model(tmp_path, dict(model_type="llama", **SMALL)), StepSpec(batch=B, seq=S),
                 ImplSpec(profile="traced", device="cpu"), parallel=ParallelSpec(**layout))


RULED = {
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),  # colwise q/k/v biases
    "mistral": dict(model_type="mistral", **SMALL),
    "mistral_swa": dict(model_type="mistral", **SMALL, sliding_window=16),  # S = 32 past the window
}


def _both(tmp_path, cfg, precision, attention, tp=2, recompute="none", **layout):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
    model, step = _model(tmp_path, cfg), StepSpec(batch=B, seq=S, precision=precision)
    par = ParallelSpec(tp=tp, **layout)
    return [estimate(model, step, ImplSpec(profile=p, device="cpu", attention=attention, recompute=recompute),
                     parallel=par) for p in ("traced", "hf")]


def _assert_equal(traced, ruled):
    assert traced.totals_bytes == ruled.totals_bytes  # activations, parameters, gradients, states, buffers
    assert [(p.name, p.bytes) for p in traced.phases] == [(p.name, p.bytes) for p in ruled.phases]
    assert traced.peak_bytes == ruled.peak_bytes


# With one KV head per rank, transformers' repeat_kv (expand + reshape) returns a view (PyTorch
# merges the size-1 head dim), which SDPA saves as it is: the window materializes SDPA's mask, so
# repeat_kv runs (without a mask SDPA takes enable_gqa instead). A real tp = 2 run of the tiny
# Mistral with a 16-token window (tests/parallel/test_traced_tp_dist.py) saves the traced bytes to
# the byte; the hf rules (estimate/attention.py attention_core) count no copy there either.


@pytest.mark.slow  # a trace at the rank's shapes: ~5-10 s each on 2 shared cores
@pytest.mark.usefixtures("traced_cache")
@pytest.mark.parametrize("family, precision, attention", [
    (f, p, a) for f in RULED for p in ("fp32", "bf16") for a in ("eager", "sdpa")])
def test_traced_tp_equals_hf_rules(tmp_path, family, precision, attention):
    _assert_equal(*_both(tmp_path, RULED[family], precision, attention))


@pytest.mark.slow
@pytest.mark.usefixtures("traced_cache")
@pytest.mark.parametrize("family, precision, attention, layout", [
    ("llama", "fp32", "sdpa", dict(sp=True)), ("qwen2", "bf16", "eager", dict(sp=True)),
    ("mistral_swa", "bf16", "eager", dict(sp=True)), ("llama", "bf16", "sdpa", dict(loss_parallel=False)),
    ("qwen2", "bf16", "eager", dict(sp=True, loss_parallel=False)),
])
def test_traced_sp_and_gathered_logits_equal_hf_rules(tmp_path, family, precision, attention, layout):
    cfg = {**RULED[family], "num_hidden_layers": 4}  # cut to 3 blocks: block 1 checked against block 0
    _assert_equal(*_both(tmp_path, cfg, precision, attention, **layout))


@pytest.mark.slow
@pytest.mark.usefixtures("traced_cache")
@pytest.mark.parametrize("tp, recompute, sp", [(4, "none", True), (2, "full", False), (2, "full", True)])
def test_traced_tp4_and_recompute_equal_hf_rules(tmp_path, tp, recompute, sp):
    cfg = {**RULED["llama"], "num_key_value_heads": 4}  # tp = 4 divides the KV heads
    _assert_equal(*_both(tmp_path, cfg, "bf16", "sdpa", tp=tp, recompute=recompute, sp=sp))


@pytest.mark.slow
@pytest.mark.usefixtures("traced_cache")
def test_traced_tp_follows_the_plan_and_refuses_what_it_does_not_model(tmp_path):
    """olmo2's plan gathers q/k/v (``colwise_gather_output``: its q/k norms span every head) and
    splits o_proj's replicated input (``rowwise_split_input``): each rank runs every head, and
    saves the gathered q/k for the norms and its slice of the attention output for o_proj."""
    from trainmem.errors import UnsupportedError
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
    step, impl = StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(profile="traced", device="cpu")
    model = _model(tmp_path, dict(model_type="olmo2", **SMALL))
    one, two = (estimate(model, step, impl, parallel=ParallelSpec(tp=t)) for t in (1, 2))
    acts = [{i.name: i.shape for i in e.inventory if i.category.value == "activation"} for e in (one, two)]
    blk = "model.layers.1."
    assert acts[1][blk + "mlp.up_proj.mm"] == (B * S, 88)  # colwise: F/tp, named as on one device
    assert acts[1][blk + "self_attn.q_norm.mul"] == acts[0][blk + "self_attn.q_norm.mul"] == (B, S, 64)  # gathered
    assert acts[1][blk + "self_attn._scaled_dot_product_flash_attention_for_cpu"] == (B, 4, S, 16)  # all heads
    assert acts[1][blk + "self_attn.o_proj.clone"] == (B, S, 32)  # the rank's slice, a clone
    assert set(acts[1]) - set(acts[0]) == {f"model.layers.{i}.self_attn.o_proj.clone" for i in range(3)}
    moe = dict(model_type="qwen3_moe", **{**SMALL, "moe_intermediate_size": 32}, num_experts=4,
               num_experts_per_tok=2, head_dim=16)
    with pytest.raises(UnsupportedError, match="moe_tp_experts"):
        estimate(_model(tmp_path, moe), step, impl, parallel=ParallelSpec(tp=2))
    gpt2 = dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=500, n_positions=128)
    with pytest.raises(UnsupportedError, match="no base_model_tp_plan"):
        estimate(_model(tmp_path, gpt2), step, impl, parallel=ParallelSpec(tp=2))
