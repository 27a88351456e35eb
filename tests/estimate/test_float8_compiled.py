"""Float8 with ``--compile`` per block (``estimate/float8.py`` ``compiled_input_recomputed`` and
``compiled_scales``, used by ``rules_compiled._compiled_block``) against the compiled trace:
torchao's own ``Float8Linear`` inside decoder blocks compiled alone, partitioned as inductor
partitions them (``trace/compiled.py``), on fake tensors and on real CPU tensors (torch 2.13
runs ``_scaled_mm`` on the CPU). The trace side compiles twice per case (30-90 s): slow.
"""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

# tests/trace/tiny_models.py's LLAMA: H=64, F=176, 4 heads of 16, V=1000, 2 layers (all 14 linears converted)
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
GQA = dict(LLAMA, num_key_value_heads=2, intermediate_size=128)


def _impl(recipe: str, **kw) -> ImplSpec:
    return ImplSpec(device="cpu", compile=True, compile_scope="block", float8=recipe, optimizer_impl="foreach", **kw)


def _saved(config, recipe, precision, batch=2, seq=64, **kw) -> tuple[int, int]:
    """Autograd's saved set: the items less the loss the caller holds (``loss.value``, not saved)."""
    items = activation_items(spec_from_hf_config(config), StepSpec(batch=batch, seq=seq, precision=precision),
                             _impl(recipe, **kw))
    items = [i for i in items if i.name != "loss.value"]
    return sum(i.bytes for i in items), len(items)


def test_per_block_float8_exact():
    # the compiled trace of tests/trace/tiny_models.py's LLAMA, B=2, S=64, per block (test below):
    # bf16 without Float8 1122820 B in 38 tensors; with it each block recomputes its two RMSNorm
    # outputs (2 x B*S*H*2 = 32768) and act(gate)*up (B*S*F*2 = 45056): 2 x 77824 fewer;
    # tensorwise keeps per converted linear a bf16 amax and an fp32 inverse scale: 2 x 7 x (2 + 4) = 84
    assert _saved(LLAMA, "none", "bf16") == (1122820, 38)
    assert _saved(LLAMA, "rowwise", "bf16") == (1122820 - 2 * 77824, 38 - 6)  # 967172, traced
    assert _saved(LLAMA, "tensorwise", "bf16") == (967172 + 84, 32 + 28)  # 967256, traced
    # fp32: 2 x (2 x 32768 + 90112) fewer than without, 2 x 7 x (4 + 4) of scalars: 1380980, traced
    none_fp32 = _saved(LLAMA, "none", "fp32")[0]
    assert _saved(LLAMA, "tensorwise", "fp32") == (none_fp32 - 2 * (2 * 32768 + 90112) + 112, 60) == (1380980, 60)
    # amp-bf16: no autocast weight copies for the converted linears (a Float8Linear is no F.linear: 2 x
    # (7 linears' bf16 weights, 2 x (4*64*64 + 3*176*64) B) fewer), the amax scalars in the weights' fp32
    none_amp = _saved(LLAMA, "none", "amp-bf16")[0]
    assert _saved(LLAMA, "tensorwise", "amp-bf16") == (
        none_amp - 2 * (77824 + 2 * (4 * 64 * 64 + 3 * 176 * 64)) + 2 * 7 * 8, 61) == (1148532, 61)  # traced


def test_unchecked_compiled_float8_is_refused_by_name():
    qwen2 = dict(LLAMA, model_type="qwen2")  # q/k/v biases: not checked with Float8 under compile
    # rowwise + full or op in bf16 is replayed (test_float8_compiled_recompute.py, test_float8_compiled_rowwise_op.py)
    # with every linear converted: an F not a multiple of 16 leaves the MLP's in bf16
    for config, kw in [(LLAMA, dict(compile_scope="model")),
                       (dict(LLAMA, intermediate_size=168), dict(recompute="op", float8="rowwise")), (qwen2, {})]:
        impl = ImplSpec(device="cpu", compile=True, **{"compile_scope": "block", "float8": "tensorwise", **kw})
        with pytest.raises(UnsupportedError, match=f"float8='{impl.float8}'"):
            activation_items(spec_from_hf_config(config), StepSpec(batch=1, seq=16, precision="bf16"), impl)


def _real_saved_bytes(config, step: StepSpec, impl: ImplSpec) -> int:
    """What autograd keeps in a real compiled forward of the converted model (real CPU tensors),
    after one warm-up step: torchao's conversion, then each block compiled alone."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import compile_model
    from trainmem.trace.float8 import convert_float8
    from trainmem.trace.saved import saved_tensors

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype({"fp32": torch.float32, "bf16": torch.bfloat16}[step.precision])
    try:
        model = build_hf_model(config, attention=impl.attention)
    finally:
        torch.set_default_dtype(old)
    model.train()
    convert_float8(model, impl)
    compiled, _ = compile_model(model, impl)
    ids = torch.randint(0, config["vocab_size"], (step.batch, step.seq))
    compiled(ids, labels=ids).loss.backward()
    saved, out = saved_tensors(model, lambda: compiled(ids, labels=ids).loss)
    del out
    return sum(t.nbytes for t in saved)


@pytest.mark.slow
@pytest.mark.parametrize("config,recipe,precision,batch,seq", [
    (LLAMA, "tensorwise", "bf16", 2, 64), (GQA, "rowwise", "bf16", 3, 40), (GQA, "tensorwise", "fp32", 1, 48)])
def test_estimate_equals_the_compiled_float8_trace(config, recipe, precision, batch, seq):
    pytest.importorskip("torchao.float8")
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=batch, seq=seq, precision=precision), _impl(recipe)
    c = trace_step(config, step, impl).meta["compile"]
    assert c["scope"] == "block" and c["regions"] == 2
    assert (c["saved_compiled_bytes"], c["saved_compiled_tensors"]) == _saved(config, recipe, precision, batch, seq)
    if config is LLAMA:  # the fake trace against the real compiled step
        assert _real_saved_bytes(config, step, impl) == c["saved_compiled_bytes"] == 967256
