"""QLoRA against bitsandbytes itself: 4-bit storage and the saved set, on CPU.

bitsandbytes >= 0.49 quantizes and runs 4-bit matmuls on CPU; older builds need CUDA, so this
module is skipped without it (checked with 0.50.2: ``pip install bitsandbytes``). What a CUDA
build adds (kernel workspaces, the allocator) is not measured here.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512)
B, S = 2, 32


def _quantize(module, double_quant: bool) -> None:
    """What transformers' bnb integration does: every nn.Linear but the head becomes Linear4bit."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and name != "lm_head":
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=double_quant, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=double_quant)
            q = q.to("cpu")
            if q.weight.quant_state is None:
                q.weight._quantize("cpu")
            setattr(module, name, q)
        else:
            _quantize(child, double_quant)


def _storage_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        total += p.untyped_storage().nbytes()
        qs = getattr(p, "quant_state", None)
        if qs is None:
            continue
        total += qs.absmax.untyped_storage().nbytes() + qs.code.untyped_storage().nbytes()
        if qs.offset is not None:
            total += qs.offset.untyped_storage().nbytes()
        if qs.state2 is not None:
            total += qs.state2.absmax.untyped_storage().nbytes() + qs.state2.code.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("targets,dropout", [(("all-linear",), 0.0), (("q_proj", "v_proj"), 0.1)])
def test_qlora_storage_and_saved_set_match_bitsandbytes(double_quant, targets, dropout):
    torch.manual_seed(0)
    model = build_hf_model(CFG, dtype=torch.bfloat16)
    _quantize(model, double_quant)
    for p in model.parameters():
        p.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, target_modules="all-linear" if targets == ("all-linear",) else list(targets),
        lora_dropout=dropout))
    model.train()
    ids = torch.randint(0, CFG["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()  # MatMul4Bit's backward runs: the saved set was enough
    ft = FinetuneSpec(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=targets, lora_dropout=dropout,
                      double_quant=double_quant)
    spec, step = spec_from_hf_config(CFG), StepSpec(batch=B, seq=S, precision="bf16")
    acts = activation_items(spec, step, ImplSpec(device="cpu"), ft)
    # with the loss the caller holds (not saved): the estimate's loss.value
    assert sum(i.bytes for i in acts) == sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()
    est = estimate(spec, step, ImplSpec(device="cpu"), finetune=ft)
    assert est.totals_bytes["parameter"] == _storage_bytes(model)
