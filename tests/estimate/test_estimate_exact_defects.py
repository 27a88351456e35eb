"""Exactness defects of the hf rules, each pinned with == against what PyTorch really keeps.

2. ForCausalLMLoss pads the labels to (B, S+1); at B=1 ``labels[..., 1:].contiguous()`` is already
   contiguous and nll_loss keeps the padded storage, (S+1)·8 bytes, not B·S·8 (tiny Llama, S=32:
   estimate 470,660 vs real 470,668 bytes before the fix).
3. Under selective recompute the checkpointed attention function holds the position ids.
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
    held = loss.untyped_storage().nbytes()  # the loss the caller holds, not saved: the item loss.value
    del loss
    items = activation_items(spec_from_hf_config(LLAMA), StepSpec(batch=batch, seq=32, precision="fp32"),
                             ImplSpec(attention="eager", device="cpu"))
    estimated, measured = sum(i.bytes for i in items), sum(s.nbytes for s in saved) + held
    assert estimated == measured, explain_difference(items, saved)
    assert [i.bytes for i in items if i.name == "loss.target"] == [(33 if batch == 1 else 64) * 8]


def _retained(cfg, impl, batch=2, seq=32):
    """Bytes a real bf16 forward makes and still holds when it returns (checkpoint regions included),
    with the ids and the loss (the estimate's ``loss.value``), as test_groundtruth_hf.py measures under
    checkpointing."""
    import contextlib

    from trainmem.trace.recompute import enable_recompute, selective_recompute
    from trainmem.trace.torch_state import default_dtype
    from trainmem.trace.saved import retained_bytes

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        model = build_hf_model(cfg, attention=impl.attention)
    model.train()
    enable_recompute(model, impl)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    core = selective_recompute(model, impl.attention) if impl.recompute == "selective" else contextlib.nullcontext()
    with core:
        kept, loss = retained_bytes(model, lambda: model(ids, labels=ids).loss)
    return kept + ids.untyped_storage().nbytes()


def test_selective_recompute_holds_the_position_ids():
    # 3. the checkpointed attention function gets position_ids in **kwargs: 256 B (1 x S int64)
    # under before the fix (1,067,780 vs 1,068,036 bytes)
    cfg = {**LLAMA, "num_hidden_layers": 5}
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="selective")
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=2, seq=32, precision="bf16"), impl)
    assert sum(i.bytes for i in items) == _retained(cfg, impl)


@pytest.mark.parametrize("batch,seq", [(1, 128), (2, 64)])
def test_gpt2_full_recompute_keeps_what_the_rules_count(batch, seq):
    # 5. GPT-2 views its ids (input_ids.view(-1, S)), so a live-storage count that does not skip them
    # counts their storage twice: 1 x 128 x 8 = 1,024 B at B=1, S=128 -- the "missing position-id
    # tensor" reported. Skipping the ids and adding them once, as test_groundtruth_hf.py does: ==.
    from trainmem.trace.live import LiveStorages
    from trainmem.trace.storages import storage_key

    cfg = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=256)
    torch.manual_seed(0)
    model = build_hf_model(cfg, attention="sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with LiveStorages(skip_keys=skip) as live:
        loss = model(ids, labels=ids).loss
    measured = live.now + ids.untyped_storage().nbytes()  # the loss too: the estimate's loss.value
    assert loss.untyped_storage().nbytes() == 4  # fp32, 0-dim
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=batch, seq=seq, precision="fp32"),
                             ImplSpec(attention="sdpa", device="cpu", recompute="full"))
    assert sum(i.bytes for i in items) == measured
