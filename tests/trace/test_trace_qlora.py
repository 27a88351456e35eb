"""trace --finetune qlora: bitsandbytes' and torchao's own 4-bit base on fake tensors (trace/qlora.py).

Each case traces the step on fake tensors and on real CPU tensors (bitsandbytes 0.50.2, torchao
0.18.0: a genuine ``Params4bit`` there), and compares with ``estimate`` for the same flags:
  - fake == real: the peak and every ledger at the peak;
  - parameters (4-bit codes and every quantization constant, adapters, the rest of the base),
    gradients, optimizer states and saved activations equal the estimate's items to the byte
    (logical bytes, no rounding). The trace's ``ones_like`` item is the 4-byte seed gradient
    ``loss.backward()`` makes before backward's first op (torch/autograd/__init__.py ``_make_grads``),
    which the trace files with the forward's tensors and the estimate in backward; the same item is
    in every trace, with or without fine-tuning.
Llama and Qwen2 (q/k/v biases beside 4-bit weights), bf16 / fp32 / amp-bf16, double quantization on
and off, a 4-bit head, qlora_scope targeted, fp4, dropout, adapters in the base's dtype, full recompute.
Slow: a fake and a real trace each (3-8 s a case alone on two loaded cores).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

# every linear a multiple of 64·256 weights (torchao's to_nf4 needs it): 4 KV heads of 32
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)
FAMILIES = {"llama": dict(model_type="llama", **SMALL), "qwen2": dict(model_type="qwen2", **SMALL)}
LEDGERS = (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE, Category.ACTIVATION)
SEED = "ones_like"

CASES = [pytest.param(*c, marks=pytest.mark.slow, id=f"{c[0]}-{c[1]}-{c[2]}-{i}") for i, c in enumerate([
    ("llama", "bf16", "none", dict(lora_targets=("all-linear",))),
    ("llama", "bf16", "none", dict(quant_impl="torchao-nf4", lora_targets=("all-linear",))),
    ("qwen2", "bf16", "none", dict(double_quant=False, quantize_head=True)),
    ("qwen2", "bf16", "none", dict(quant_impl="torchao-nf4", qlora_scope="targeted", lora_dropout=0.1)),
    ("llama", "fp32", "none", dict()),
    ("llama", "amp-bf16", "none", dict(lora_targets=("all-linear",))),
    ("llama", "bf16", "full", dict(quant_impl="torchao-nf4")),
    ("llama", "bf16", "none", dict(quant_type="fp4", adapter_dtype="param")),
])]


def _bytes(items, category: Category) -> int:
    return sum(i.bytes for i in items if i.category == category and i.name != SEED)


@pytest.mark.parametrize("family,precision,recompute,kw", CASES)
def test_qlora_trace_equals_real_and_the_estimate(family, precision, recompute, kw):
    cfg, ft = FAMILIES[family], FinetuneSpec(mode="qlora", **kw)
    step, impl = StepSpec(batch=2, seq=32, precision=precision), ImplSpec(attention="eager", recompute=recompute)
    fake = trace_step(cfg, step, impl, finetune=ft)
    real = trace_step(cfg, step, impl, finetune=ft, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    est = estimate(spec_from_hf_config(cfg), step, ImplSpec(attention="eager", recompute=recompute, device="cpu"),
                   finetune=ft)
    for category in LEDGERS:
        assert _bytes(fake.items, category) == _bytes(est.inventory.items, category), category
    assert sum(1 for i in fake.items if i.name == SEED and i.bytes == 4) == 1


@pytest.mark.slow
def test_the_4bit_storages_are_named_as_the_estimate_names_them():
    # llama bnb with double quantization: per 4-bit weight the codes and five constants
    cfg, ft = FAMILIES["llama"], FinetuneSpec(mode="qlora")
    step = StepSpec(batch=1, seq=16, precision="bf16")
    traced = {i.name.removeprefix("base_model.model.").replace(".base_layer", ""): i.bytes
              for i in trace_step(cfg, step, ImplSpec(attention="eager"), finetune=ft).items
              if i.category == Category.PARAMETER}
    est = {i.name: i.bytes for i in estimate(spec_from_hf_config(cfg), step, ImplSpec(device="cpu"),
                                             finetune=ft).inventory.items if i.category == Category.PARAMETER}
    assert traced == est
    # q_proj 128·128 = 16384 weights: codes 8192, absmax 16384/64 = 256 (uint8), absmax2 ⌈256/256⌉·4,
    # offset 4, the 8-bit map 256·4, the NF4 code book 16·4
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [traced[q + s] for s in ("", ".absmax", ".absmax2", ".absmax_offset", ".absmax_code", ".quant_code")] == [
        8192, 256, 4, 4, 1024, 64]
