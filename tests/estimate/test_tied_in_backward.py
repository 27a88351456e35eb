"""``--optimizer-in-backward`` with a tied head (``tie_word_embeddings``): the shared weight has
one post-accumulate-grad hook, which fires once, after autograd summed the head's gradient (made
first) and the embedding's (made last). So the head's gradient stays alive through backward and
the end of backward holds the two and their sum (estimate/peak.py, ``tied_head``).

A tiny tied Llama (h64, 2 layers, V8000: the embedding dominates; B1, S16), CPU kernels. The
input ids are the embedding's saved indices: the estimate names them ``model.embed_tokens.indices``,
the trace and the real run count that one storage once, so no term is added here.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate
from trainmem.estimate.model_states import optimizer_step_transient_bytes
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.live import LiveStorages
from trainmem.trace.optimizers import _make_optimizer
from trainmem.trace.torch_state import default_dtype

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, tie_word_embeddings=True)
UNTIED = {**CFG, "tie_word_embeddings": False}
B, S = 1, 16
TIED_NUMEL = 8000 * 64  # 512000: embed_tokens.weight, which is also the head's


def _specs(precision, impl="fused", recompute="none", in_backward=True):
    return (StepSpec(batch=B, seq=S, precision=precision, optimizer="adamw"),
            ImplSpec(attention="sdpa", device="cpu", optimizer_impl=impl, optimizer_in_backward=in_backward,
                     recompute=recompute))


def _phase(est, name):
    return next(p for p in est.phases if p.name == name)


@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_tied_gradient_lives_through_backward(precision, elem):
    step, im = _specs(precision)
    tied, untied = estimate(spec_from_hf_config(CFG), step, im), estimate(spec_from_hf_config(UNTIED), step, im)
    T = TIED_NUMEL * elem
    # the head's gradient is alive in the last block's backward; at the end the head's, the
    # embedding's and their sum (T = 512000·elem is larger than the residual 16·64·elem)
    assert _phase(tied, "backward").parts["gradients"] == T
    assert _phase(tied, "backward_end").parts["gradients"] == 3 * T
    assert "work" not in _phase(tied, "backward_end").parts  # the embedding's output gradient is freed
    # untied: every gradient is stepped and freed in its own hook
    assert "gradients" not in _phase(untied, "backward").parts
    assert "gradients" not in _phase(untied, "backward_end").parts
    # without the optimizer in backward every gradient is stored, the sum as the tied weight's .grad,
    # and the head's and the embedding's gradients are alive beside it while autograd sums them
    normal = estimate(spec_from_hf_config(CFG), *_specs(precision, in_backward=False))
    assert _phase(normal, "backward_end").parts["gradients"] == tied.totals_bytes["gradient"] + 2 * T


GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=64)


@pytest.mark.parametrize("cfg,precision", [
    (CFG, "fp32"),
    pytest.param(CFG, "bf16", marks=pytest.mark.slow),
    pytest.param(GPT2, "fp32", marks=pytest.mark.slow),  # learned positions: their ids are freed first
    pytest.param(GPT2, "bf16", marks=pytest.mark.slow)])
def test_tied_sum_at_the_end_of_a_plain_backward(cfg, precision):
    """No optimizer in backward, SGD (no states: the end of backward is the step's peak). The tied
    weight's AccumulateGrad gets the sum of the head's and the embedding's gradients, made out of
    place (torch/csrc/autograd/input_buffer.cpp accumulate): the estimate read the end of backward
    with one of the three (GPT-2 fp32: 1,007,360 B under the trace) and now equals it."""
    step = StepSpec(batch=B, seq=S, precision=precision, optimizer="sgd")
    im = ImplSpec(attention="sdpa", device="cpu")
    est, t = estimate(spec_from_hf_config(cfg), step, im), trace_step(cfg, step, im)
    assert est.peak_phase == "backward_end"
    assert t.peak_logical_bytes == est.peak_bytes, (t.peak_logical_bytes, est.peak_bytes)


def _head_moment(result) -> int:
    """Most bytes alive in the trace from the head's first backward op to the last block's first."""
    rec = result.recording
    live, top, started = 0, 0, False
    for e in rec.events:
        b = rec.blocks[e if e >= 0 else ~e]
        if b.phase == "backward" and (b.module == "lm_head" or b.module.startswith("model.layers.1")):
            if b.module != "lm_head":
                return top
            started = True
        live += b.nbytes if e >= 0 else -b.nbytes
        if started:
            top = max(top, live)
    return top


def _torchtune_register():
    """torchtune's own ``register_optim_in_bwd_hooks`` (torchtune/training/memory.py). Importing
    torchtune pulls torchao modules this environment's torchao lacks, so the function is compiled
    from torchtune's installed source file alone (it needs only ``torch``)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "training" / "memory.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "register_optim_in_bwd_hooks")
    from typing import Dict
    ns = {"torch": torch, "Dict": Dict}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns["register_optim_in_bwd_hooks"]


def _real_step(step, impl) -> tuple[int, int, list[str]]:
    """(whole-step peak, host step counters, hook order) of a real CPU step under torchtune's
    optimizer-in-backward, steady state."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if step.precision == "bf16" else torch.float32):
        model = build_hf_model(CFG, attention="sdpa")
    model.train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # full_finetune_single_device.py _setup_optimizer: one optimizer per parameter, then the hooks
    optim_dict = {p: _make_optimizer("adamw", [p], impl.optimizer_impl) for p in model.parameters()}
    _torchtune_register()(model, optim_dict)
    order: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    ids = torch.randint(0, CFG["vocab_size"], (B, S))

    def one():
        order.clear()
        loss = model(ids, labels=ids).loss
        loss.backward()
        del loss

    one()  # states exist from here on
    states = [v for o in optim_dict.values() for s in o.state.values() for v in s.values()]
    steps = sum(v.untyped_storage().nbytes() for o in optim_dict.values() for s in o.state.values()
                for k, v in s.items() if k == "step")
    with LiveStorages([*model.parameters(), *model.buffers(), ids, *states]) as live:
        one()
    return live.peak, steps, list(order)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "for-loop"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tied_in_backward_estimate_trace_real(precision, impl):
    step, im = _specs(precision, impl)
    est = estimate(spec_from_hf_config(CFG), step, im)
    t = trace_step(CFG, step, im)
    assert t.peak_logical_bytes == est.peak_bytes, (t.peak_logical_bytes, est.peak_bytes, est.peak_phase)
    assert est.peak_phase == "backward_end"  # the sum of the tied weight's two gradients
    if impl == "for-loop":  # the tied weight's step (its gradient, sqrt and quotient) reaches the same bytes
        one_param, _ = optimizer_step_transient_bytes(spec_from_hf_config(CFG), step, im)
        assert one_param == 2 * TIED_NUMEL * (4 if precision == "fp32" else 2)
        assert _phase(est, "step_in_backward").bytes == est.peak_bytes

    if impl == "fused":  # no temporaries: the head's matmul is the largest moment of step_in_backward
        assert "the tied head's matmul" in _phase(est, "step_in_backward").note
        assert _head_moment(t) == _phase(est, "step_in_backward").bytes

    real_peak, steps, order = _real_step(step, im)
    assert order[-1] == "model.embed_tokens.weight" and order.count("model.embed_tokens.weight") == 1
    assert steps == 20 * 4  # fp32 0-dim counters: embed, 2 × (7 linears + 2 norms), norm = 20
    assert real_peak == t.peak_logical_bytes + steps


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tied_in_backward_checkpointed_estimate_trace(precision):
    step, im = _specs(precision, "foreach", recompute="full")
    est = estimate(spec_from_hf_config(CFG), step, im)
    t = trace_step(CFG, step, im)
    assert t.peak_logical_bytes == est.peak_bytes, (t.peak_logical_bytes, est.peak_bytes, est.peak_phase)
    assert est.peak_phase == "backward_end"
