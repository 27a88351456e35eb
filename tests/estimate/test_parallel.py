"""The per-rank estimator: closed forms, sharding invariants and validation (issue #4).

Agreement with real torch.distributed runs lives in tests/parallel/.
"""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.parallel_pp import in_flight, stage_layers
from trainmem.estimate.rules_megatron import megatron_layer_bytes
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

GPT = ModelSpec(family="gpt2", hidden_size=1024, num_layers=4, num_heads=16, ffn_size=4096, vocab_size=5120,
                activation="gelu_tanh", norm="layernorm", max_positions=8192)


def _layer_bytes(e, layer: int = 1) -> int:
    return sum(i.bytes for i in e.inventory if i.category is Category.ACTIVATION and i.name.startswith(f"layers.{layer}."))


@pytest.mark.parametrize("s,b,t,sp,recompute", [
    (2048, 1, 2, False, "none"), (2048, 2, 4, False, "selective"), (1024, 4, 4, True, "none"),
    (4096, 1, 8, True, "selective"), (2048, 2, 2, True, "full"), (1024, 1, 1, False, "none"),
])
def test_megatron_profile_reduces_to_the_published_forms(s, b, t, sp, recompute):
    # Korthikanti et al. 2022, Table 2: sbh(10 + 24/t + 5as/(ht)), sbh(34/t + 5as/(ht)), 2sbh
    impl = ImplSpec(profile="megatron", recompute=recompute, attention="eager")
    par = ParallelSpec(tp=t, sp=sp) if t > 1 else None
    e = estimate(GPT, StepSpec(batch=b, seq=s, precision="bf16"), impl, par)
    assert _layer_bytes(e) == megatron_layer_bytes(s, b, 1024, 16, tp=t, sp=sp, recompute=recompute)


def test_fsdp_shards_add_up_to_the_unsharded_model_states():
    m = load_model("llama-2-7b")
    step = StepSpec(batch=1, seq=2048, precision="mixed-bf16")
    single = estimate(m, step).totals_bytes
    for dp in (2, 8, 64):
        rank = estimate(m, step, ImplSpec(), ParallelSpec(dp=dp, fsdp="full")).ranks[0].totals_bytes
        for ledger in ("parameter", "gradient", "master_weight", "optimizer_state"):
            assert abs(rank[ledger] * dp - single[ledger]) <= dp * 8, ledger  # ceil per tensor


def test_zero_stages_never_raise_model_states():
    m = load_model("llama-3-8b")
    step = StepSpec(batch=1, seq=2048, precision="mixed-bf16")
    states = []
    for z in (0, 1, 2, 3):
        t = estimate(m, step, ImplSpec(), ParallelSpec(dp=8, zero=z)).ranks[0].totals_bytes
        states.append(sum(t[k] for k in ("parameter", "gradient", "master_weight", "optimizer_state")))
    assert states == sorted(states, reverse=True) and states[0] > states[3]


def test_data_parallel_does_not_split_activations():
    m = load_model("llama-2-7b")
    step = StepSpec(batch=1, seq=2048)
    single = estimate(m, step).totals_bytes["activation"]
    assert estimate(m, step, ImplSpec(), ParallelSpec(dp=8, zero=3)).ranks[0].totals_bytes["activation"] == single


def test_tensor_and_sequence_parallel_split_activations():
    m = load_model("llama-2-7b")
    step = StepSpec(batch=1, seq=4096)
    a1 = estimate(m, step).totals_bytes["activation"]
    a_tp = estimate(m, step, ImplSpec(), ParallelSpec(tp=4)).ranks[0].totals_bytes["activation"]
    a_sp = estimate(m, step, ImplSpec(), ParallelSpec(tp=4, sp=True)).ranks[0].totals_bytes["activation"]
    assert a_sp < a_tp < a1


def test_pipeline_stages_and_schedules():
    m = load_model("llama-2-7b")
    assert stage_layers(m, ParallelSpec(pp=3)) == [(0, 11), (11, 22), (22, 32)]
    assert stage_layers(m, ParallelSpec(pp=2, layer_split=(20, 12))) == [(0, 20), (20, 32)]
    # 1F1B keeps pp - stage micro-batches in flight, GPipe all of them
    assert [in_flight(ParallelSpec(pp=4, microbatches=8), s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(ParallelSpec(pp=4, microbatches=8, schedule="gpipe"), 3) == 8
    step = StepSpec(batch=1, seq=2048)
    e = estimate(m, step, ImplSpec(), ParallelSpec(pp=4, microbatches=8))
    assert [r.name for r in e.ranks] == ["pp_stage_0", "pp_stage_1", "pp_stage_2", "pp_stage_3"]
    first, last = e.ranks[0].totals_bytes, e.ranks[-1].totals_bytes
    assert first["activation"] > last["activation"]  # more micro-batches in flight on stage 0
    gpipe = estimate(m, step, ImplSpec(), ParallelSpec(pp=4, microbatches=8, schedule="gpipe"))
    assert gpipe.peak_bytes > e.peak_bytes
    # the last stage holds the loss; only it has log-softmax items
    assert any(i.name == "loss.log_softmax" for i in e.ranks[-1].inventory)
    assert not any(i.name == "loss.log_softmax" for i in e.ranks[0].inventory)


def test_offload_moves_bytes_to_host():
    m = load_model("llama-2-7b")
    step = StepSpec(batch=1, seq=2048, precision="mixed-bf16")
    base = estimate(m, step, ImplSpec(), ParallelSpec(dp=8, zero=3)).ranks[0]
    off = estimate(m, step, ImplSpec(), ParallelSpec(dp=8, zero=3, offload=("optimizer",))).ranks[0]
    assert off.host_bytes == base.totals_bytes["optimizer_state"] + base.totals_bytes["master_weight"]
    assert off.peak_bytes < base.peak_bytes


@pytest.mark.parametrize("par,needle", [
    (dict(tp=3), "tp=3"), (dict(tp=16), "kv_heads=8"), (dict(pp=64), "pp=64"),
    (dict(pp=2, layer_split=(10, 10)), "layer_split"), (dict(cp=3), "cp=3"),
    (dict(ep=2), "ep=2"),
])
def test_invalid_combinations_name_every_degree(par, needle):
    with pytest.raises(SpecError) as err:
        estimate(load_model("llama-3-8b"), StepSpec(batch=1, seq=4096), ImplSpec(attention="flash"), ParallelSpec(**par))
    assert needle in str(err.value)


def test_json_ranks_contract():
    e = estimate(load_model("llama-2-7b"), StepSpec(batch=1, seq=2048), ImplSpec(),
                 ParallelSpec(dp=2, tp=2, sp=True, pp=2, microbatches=4, zero=1))
    d = e.to_dict(items=False)
    assert d["peak_bytes"] == max(r["peak_bytes"] for r in d["ranks"])
    for r in d["ranks"]:
        assert {"name", "count", "totals_bytes", "peak_bytes", "host_bytes"} <= set(r)
        assert r["count"] == 4


def test_the_pipeline_steps_are_pure_and_exact():
    """apply_zero / apply_offload / apply_pp / apply_cp, the steps rank_classes composes."""
    from trainmem.estimate.parallel_pp import apply_pp
    from trainmem.estimate.parallel_tp import apply_cp, apply_tp
    from trainmem.estimate.parallel_zero import apply_offload, apply_zero
    from trainmem.inventory import Category, MemoryItem

    n = 4096 * 14336  # one up_proj of Llama-3-8B: 58,720,256 elements
    name = "model.layers.0.mlp.up_proj.weight"
    items = [MemoryItem.make(name, Category.PARAMETER, (4096, 14336), "bfloat16", 2 * n),
             MemoryItem.make(f"{name}.grad", Category.GRADIENT, (4096, 14336), "bfloat16", 2 * n),
             MemoryItem.make(f"{name}.exp_avg", Category.OPTIMIZER_STATE, (4096, 14336), "float32", 4 * n)]
    div = {it.name: 2 for it in items}  # column-parallel over tp=2
    z1 = apply_zero(items, div, zero=1, group=8)
    # ZeRO-1 shards only the optimizer state over the 8 ranks: ⌈n/16⌉·4 = 3,670,016·4; the rest ÷ tp only
    assert [it.bytes for it in z1] == [58_720_256, 58_720_256, 14_680_064]
    z3 = apply_zero(items, div, zero=3, group=8)
    assert [it.bytes for it in z3] == [7_340_032, 7_340_032, 14_680_064]  # ⌈n/16⌉·2 for bf16
    kept, host = apply_offload(z3, ("optimizer",))
    assert [it.name for it in kept] == [name, f"{name}.grad"] and host == 14_680_064
    kept, host = apply_offload(z3, ("optimizer", "params"))
    assert [it.name for it in kept] == [f"{name}.grad"] and host == 14_680_064 + 7_340_032
    assert items[0].bytes == 2 * n  # inputs untouched
    assert apply_pp(items, [0, 1, 1], 1) == items[1:]
    model, step = load_model("llama-3-8b"), StepSpec(batch=1, seq=4096)
    assert apply_cp(step, ParallelSpec(cp=4)).seq == 1024 and apply_cp(step, ParallelSpec()) is step
    lm = apply_tp(model, ParallelSpec(tp=4))
    assert (lm.num_heads, lm.num_kv_heads, lm.ffn_size, lm.vocab_size) == (8, 2, 3584, 32064)  # ⌈128256/4⌉
