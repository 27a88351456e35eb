"""The routers' load-balancing loss (``output_router_logits``, transformers' ``load_balancing_loss_func``):
what it keeps, per MoE block, until backward (``estimate/rules_hf_moe.py`` ``load_balancing_items``), and the
router-logit gradients it leaves waiting at the loss's backward (``estimate/peak.py``), against the trace and
a real CPU forward."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

QWEN = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=176, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
            max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, num_local_experts=8,
               num_experts_per_tok=2)
CPU = ImplSpec(device="cpu")


def _step(precision):
    return StepSpec(batch=2, seq=64, precision=precision, optimizer="sgd")


def _aux(config):
    return dict(config, output_router_logits=True, router_aux_loss_coef=0.01)


def _kept(config, precision):
    items = activation_items(spec_from_hf_config(config), _step(precision), CPU)
    return sum(i.bytes for i in items), len(items)


@pytest.mark.parametrize("config, precision, added", [
    # T = B·S = 128 rows. Qwen3-MoE E=4: two blocks' softmax 128·4·2 = 1,024 B each (bf16), the counts 4·4 = 16
    (QWEN, "bf16", 2 * 1024 + 16), (QWEN, "fp32", 2 * 2048 + 16),
    # Mixtral E=8: 128·8·2 = 2,048 B each (bf16), the counts 32
    (MIXTRAL, "bf16", 2 * 2048 + 32), (MIXTRAL, "fp32", 2 * 4096 + 32)])
def test_the_kept_set_as_integers(config, precision, added):
    base, n = _kept(config, precision)
    assert _kept(_aux(config), precision) == (base + added, n + 3)  # == a real CPU forward's (slow test below)


def test_only_moe_blocks_keep_a_softmax():
    mixed = dict(QWEN, num_hidden_layers=3, mlp_only_layers=[1])  # block 1 dense
    names = [i.name for i in activation_items(spec_from_hf_config(_aux(mixed)), _step("bf16"), CPU)]
    assert [n for n in names if n.startswith("loss.load_balancing.")] == [
        "loss.load_balancing.probs_layer0", "loss.load_balancing.probs_layer2", "loss.load_balancing.tokens_per_expert"]


def test_the_loss_backward_holds_the_router_logit_gradients():
    plain, aux = (estimate(spec_from_hf_config(c), _step("bf16"), CPU) for c in (QWEN, _aux(QWEN)))
    start = next(p for p in aux.phases if p.name == "backward_start")
    # the kept set (2,064 B) is released; each block's router-logit gradient (1,024 B, bf16) waits for its block
    assert start.parts["router_logits_grad"] == 2048
    assert aux.peak_phase == plain.peak_phase == "backward_start"
    assert aux.peak_bytes - plain.peak_bytes == 2048  # 2,821,480 - 2,819,432: the trace's too (slow test)


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(SpecError, match=r"^output_router_logits='yes': must be true or false$"):
        spec_from_hf_config(dict(QWEN, output_router_logits="yes"))
    model = spec_from_hf_config(_aux(QWEN))
    for impl in (ImplSpec(device="cpu", compile=True, compile_scope="block"),
                 ImplSpec(device="cpu", compile=True, recompute="full")):
        with pytest.raises(UnsupportedError, match="compile: output_router_logits=True is not modelled") as info:
            estimate(model, _step("bf16"), impl)
        assert "\n" not in str(info.value)
    with pytest.raises(SpecError, match="output_router_logits=True: .*loss=chunked-ce"):
        estimate(model, StepSpec(batch=2, seq=64, precision="bf16", loss="chunked-ce"), CPU)
    gpt_oss = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1000, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(UnsupportedError, match=r"^gpt_oss output_router_logits=True: .* qwen3_moe and mixtral only"):
        spec_from_hf_config(dict(gpt_oss, output_router_logits=True))  # its own load-balancing loss, not modelled


@pytest.mark.slow  # four fake-tensor traces and two real forwards, ~1 min on 2 shared cores
@pytest.mark.parametrize("config", [QWEN, MIXTRAL])
def test_estimate_equals_trace_and_a_real_forward(config):
    torch = pytest.importorskip("torch")
    from trainmem.models.hf import build_hf_model
    from trainmem.trace import trace_step
    from trainmem.trace.routing import force_routing
    from trainmem.trace.saved import saved_tensors

    # bf16 (grouped_mm experts): the peak, at the cross-entropy's log-softmax backward, to the byte
    est = [estimate(spec_from_hf_config(c), _step("bf16"), CPU) for c in (config, _aux(config))]
    traced = [trace_step(c, _step("bf16"), CPU) for c in (config, _aux(config))]
    assert est[1].peak_bytes == traced[1].peak_logical_bytes
    # forward's top is inside the cross-entropy, before the load-balancing loss: the output holds every block's
    # router logits (T·E·2 B each) and nothing of the loss is made yet. The estimate's forward phase is not this
    # moment's bytes (8,344 B under it for Qwen3-MoE, 6,392 for Mixtral, without the loss): its growth is
    forward_top = [max(t.timeline_allocated_bytes[:dict((n, i) for i, n in t.phases)["backward"]]) for t in traced]
    est_forward = [next(p.bytes for p in e.phases if p.name == "forward") for e in est]
    E = config.get("num_experts") or config["num_local_experts"]
    assert forward_top[1] - forward_top[0] == est_forward[1] - est_forward[0] == 2 * 128 * E * 2
    # fp32: torch 2.13's grouped_mm meta kernel is bf16 only, so the trace runs the per-expert loop, which the
    # estimate does not model (its own gap); what the loss adds is the same
    fp32 = [estimate(spec_from_hf_config(c), _step("fp32"), CPU).peak_bytes
            - trace_step(c, _step("fp32"), CPU, experts="eager").peak_logical_bytes for c in (config, _aux(config))]
    assert fp32[0] == fp32[1]

    def saved(c):  # what autograd keeps in a real bf16 forward, routed as the trace routes
        torch.manual_seed(0)
        model = build_hf_model(c, dtype=torch.bfloat16)
        ids = torch.randint(0, 1000, (2, 64))
        with force_routing(model, 0.0):
            kept, _ = saved_tensors(model, lambda: model(ids, labels=ids).loss, buffers=False)
        return sum(t.nbytes for t in kept), len(kept)

    (b0, n0), (b1, n1) = saved(config), saved(_aux(config))
    e0, e1 = _kept(config, "bf16"), _kept(_aux(config), "bf16")
    assert (b1 - b0, n1 - n0) == (e1[0] - e0[0], e1[1] - e0[1])


@pytest.mark.slow  # four fake-tensor traces, ~20 s on 2 shared cores
@pytest.mark.parametrize("dense, added", [((), 3 * 1024), ((0,), 2 * 1024)])
def test_inside_the_blocks_backward_every_router_gradient_to_come_is_alive(dense, added):
    """A small vocabulary (64) puts the peak inside the blocks' backward: there every MoE block's router-logit
    gradient (1,024 B, bf16) is alive beside the rest. Without the loss the estimate is 40,576 B under this
    trace (a gap of its own in the MoE blocks' backward moments); what the loss adds is the same."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    config = dict(QWEN, vocab_size=64, num_hidden_layers=3, mlp_only_layers=list(dense))
    traced = [trace_step(c, _step("bf16"), CPU) for c in (config, _aux(config))]
    assert [t.peak_phase for t in traced] == ["backward", "backward"]
    assert traced[1].peak_logical_bytes - traced[0].peak_logical_bytes == added
    est = [{p.name: p.bytes for p in estimate(spec_from_hf_config(c), _step("bf16"), CPU).phases}
           for c in (config, _aux(config))]
    assert est[1]["backward"] - est[0]["backward"] == added
    # the first block's backward runs last: only its own router gradient is still to come
    assert est[1]["backward_first_block"] - est[0]["backward_first_block"] == (0 if dense else 1024)


WHOLE = ImplSpec(device="cpu", compile=True)  # whole-model compile, --recompute none


def _compiled_kept(config):
    items = activation_items(spec_from_hf_config(config), BF16, WHOLE)
    return sum(i.bytes for i in items if not i.name.endswith("loss.value")), sum(
        1 for i in items if not i.name.endswith("loss.value"))


BF16 = StepSpec(batch=2, seq=64, precision="bf16")


@pytest.mark.parametrize("config, added", [
    # the loss's region keeps each block's softmax in fp32 (128·E·4) and the counts (4·E)
    (QWEN, 2 * 2048 + 16), (MIXTRAL, 2 * 4096 + 32),
    (dict(QWEN, num_experts=16, num_experts_per_tok=8), 2 * 8192 + 64),  # trace: 1,608,436 B less inv_freq
    (dict(QWEN, num_experts=128, num_experts_per_tok=8), 2 * 65536 + 512)])  # trace: 1,775,668 B less inv_freq
def test_whole_model_compile_keeps_the_softmax_in_fp32(config, added):
    base, n = _compiled_kept(config)
    assert _compiled_kept(_aux(config)) == (base + added, n + 3)


@pytest.mark.slow  # a whole-model compiled trace and a real compiled step each, ~1 min on 2 shared cores
@pytest.mark.parametrize("config", [QWEN, MIXTRAL])
def test_whole_model_compile_equals_the_trace_and_a_real_compiled_step(config):
    pytest.importorskip("torch")
    from test_compiled_moe import real_compiled_saved
    from trainmem.trace import trace_step

    traced = trace_step(_aux(config), BF16, WHOLE).meta["compile"]
    assert traced["regions"] == 2  # the model, then the load-balancing loss
    # the trace also counts inv_freq, a buffer autograd saves (head_dim / 2 fp32 values: 32 B)
    kept = _compiled_kept(_aux(config))  # Qwen3-MoE 837,188 B in 64, Mixtral 841,332 B in 56
    assert kept == (traced["saved_compiled_bytes"] - 32, traced["saved_compiled_tensors"] - 1)
    assert kept == real_compiled_saved(_aux(config), WHOLE)[0]


@pytest.mark.slow  # one fake-tensor trace each, ~10 s on 2 shared cores
@pytest.mark.parametrize("recompute, peak", [("full", 2_047_816), ("selective", 2_817_896)])
def test_checkpointed_blocks_change_nothing_of_it(recompute, peak):
    """The router logits leave a checkpointed block as its recorded output; the loss's kept set and the router-logit
    gradients are the same as without checkpointing (2,048 B over the step without the loss, at the loss's backward)."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", recompute=recompute)
    est = estimate(spec_from_hf_config(_aux(QWEN)), _step("bf16"), impl)
    assert est.peak_bytes == trace_step(_aux(QWEN), _step("bf16"), impl).peak_logical_bytes == peak
    assert est.peak_bytes - estimate(spec_from_hf_config(QWEN), _step("bf16"), impl).peak_bytes == 2048
