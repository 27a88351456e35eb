"""Exactness defects of the hf rules, each pinned with == against what PyTorch really keeps.

2. ForCausalLMLoss pads the labels to (B, S+1); at B=1 ``labels[..., 1:].contiguous()`` is already
   contiguous and nll_loss keeps the padded storage, (S+1)·8 bytes, not B·S·8 (tiny Llama, S=32:
   estimate 470,660 vs real 470,668 bytes before the fix).
"""

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.activations import activation_items
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace.saved import explain_difference, saved_tensors

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)


@pytest.mark.parametrize("batch", [1, 2])
def test_loss_targets_as_autograd_keeps_them(batch):
    torch.manual_seed(0)
    model = build_hf_model(LLAMA, attention="eager")
    ids = torch.randint(0, LLAMA["vocab_size"], (batch, 32))
    saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss)
    del loss
    items = activation_items(spec_from_hf_config(LLAMA), StepSpec(batch=batch, seq=32, precision="fp32"),
                             ImplSpec(attention="eager", device="cpu"))
    estimated, measured = sum(i.bytes for i in items), sum(s.nbytes for s in saved)
    assert estimated == measured, explain_difference(items, saved)
    assert [i.bytes for i in items if i.name == "loss.target"] == [(33 if batch == 1 else 64) * 8]
