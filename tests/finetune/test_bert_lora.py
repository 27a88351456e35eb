"""BERT under LoRA: what the frozen embeddings keep, checked against peft on a real BertForMaskedLM.

A frozen position or token-type embedding keeps no indices and its output needs no gradient
(``estimate/rules_hf.py`` ``_bert``; it used to stop with an internal StopIteration). fp32 is exact;
under CPU autocast the LayerNorm statistics differ by a few hundred bytes (not modelled further).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.saved import explain_difference, saved_tensors  # noqa: E402

B, S = 2, 32
CFG = dict(model_type="bert", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           vocab_size=500, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("targets", [("query", "value"), ("all-linear",)])
def test_bert_lora_activations_are_exact(targets):
    ft = FinetuneSpec(mode="lora", lora_targets=targets)
    torch.manual_seed(0)
    model = peft.get_peft_model(build_hf_model(CFG, attention="sdpa"), peft.LoraConfig(
        r=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_dropout=ft.lora_dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets)))
    model.train()
    ids = torch.randint(0, CFG["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss)
    held = loss.untyped_storage().nbytes()  # the loss the caller holds (not saved): the item loss.value
    del loss
    items = activation_items(spec_from_hf_config(CFG), StepSpec(batch=B, seq=S, precision="fp32"),
                             ImplSpec(attention="sdpa", device="cpu"), ft)
    assert sum(i.bytes for i in items) == sum(s.nbytes for s in saved) + held, explain_difference(items, saved)
