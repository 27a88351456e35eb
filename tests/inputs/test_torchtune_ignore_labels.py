"""torchtune's ``ignore_labels_cache`` (estimate/torchtune_loop.py): the recipes' (batch_size, 1) int64 tensor,
kept on the device all step (recipes/full_finetune_single_device.py, lora_finetune_single_device.py)."""

from __future__ import annotations

from trainmem.estimate.torchtune_loop import IGNORE_LABELS_CACHE, torchtune_loop_items
from trainmem.inputs import read_torchtune
from trainmem.inventory import Category
from trainmem.specs import StepSpec


def test_ignore_labels_cache_item_as_integers():
    (item,) = torchtune_loop_items(StepSpec(batch=3, seq=16, loss="torchtune-chunked-ce"))
    assert (item.name, item.category, item.shape, item.dtype) == (IGNORE_LABELS_CACHE, Category.BUFFER, (3, 1), "int64")
    assert item.bytes == 3 * 1 * 8 == 24 and item.formula == "B·1·8"


def test_not_kept_outside_torchtune_loss():
    assert torchtune_loop_items(StepSpec(batch=3, seq=16, loss="ce")) == []
    assert torchtune_loop_items(StepSpec(batch=3, seq=16, loss="litgpt-chunked-ce")) == []


def test_recipe_with_another_loss_says_it_is_not_counted(tmp_path):
    p = tmp_path / "recipe.yaml"
    model = "model:\n  _component_: torchtune.models.llama3.llama3_8b\nbatch_size: 4\ndtype: bf16\n"
    p.write_text(model + "loss:\n  _component_: torchtune.modules.loss.LinearCrossEntropyLoss\n")
    notes = read_torchtune(p)["notes"]
    assert any("ignore_labels_cache" in n and "LinearCrossEntropyLoss" in n for n in notes)
    p.write_text(model + "loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n")
    assert not any("ignore_labels_cache" in n for n in read_torchtune(p)["notes"])


def test_estimate_keeps_it_in_every_phase():
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec
    from trainmem.specs.loaders import spec_from_hf_config

    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128)
    ce, tt = (estimate(spec_from_hf_config(cfg), StepSpec(batch=3, seq=64, loss=loss), ImplSpec(device="cpu"))
              for loss in ("ce", "torchtune-chunked-ce"))
    (item,) = [i for i in tt.inventory.base if i.name == IGNORE_LABELS_CACHE]
    assert item.bytes == 3 * 8
    # the buffers (rotary inv_freq, original_inv_freq: 8·4 each) and the cache, in every phase the optimizer's too
    assert {p.name: p.parts["buffers"] for p in tt.phases} == {p.name: 64 + 24 for p in tt.phases}
    assert {p.parts["buffers"] for p in ce.phases} == {64}
