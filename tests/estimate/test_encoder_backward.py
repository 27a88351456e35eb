"""BERT's blocks' backward as node moments (estimate/encoder_backward.py): the step's peak equals a CPU fake-tensor
trace's. Before (estimate − trace, bytes; tiny BERT h64, F128, 2 layers, A4, V256, 3 labels, AdamW for-loop, CPU):
seq-cls fp32 B1 S64 +31,992, B2 S64 +98,552; bf16 B1 S64 +7,676, B2 S32 +7,676, B2 S64 +42,502; token-cls fp32
B1 S64 +15,608, B2 S64 +63,236; bf16 B1 S64 −516, B2 S64 +17,798 (the block working set, a bound both ways);
under --recompute full fp32 B2 S64 +98,296 (seq-cls, token-cls) / +98,808 (mlm), bf16 B1 S64 +7,676 / +7,932,
B2 S64 +17,404 / +17,660, mlm bf16 B2 S32 −7,428; amp-bf16 seq-cls B1 S64 +15,352, B2 S64 +32,012 (full +81,016),
token-cls B1 S64 +7,180."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate.encoder_nodes import BlockDims, block_events, peak_of
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

BERT = dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=512, num_labels=3)
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def _saved(precision: str, batch: int, seq: int) -> dict[str, int]:
    """The last layer's saved tensors by name, as the estimate's inventory lists them."""
    from trainmem.estimate import estimate
    from trainmem.estimate.block_backward import block_items
    from trainmem.estimate.encoder_backward import layer_saved

    spec = replace(spec_from_hf_config(BERT), head="seq-cls", num_labels=3)
    e = estimate(spec, StepSpec(batch=batch, seq=seq, precision=precision), IMPL)
    return layer_saved(block_items(e.inventory, 1), 1)


def test_fp32_top_is_the_output_dense_end():
    d = BlockDims(B=1, S=64, H=64, F=128, A=4, act=4, param=4)
    bsh, bsf = 64 * 64 * 4, 64 * 128 * 4
    work, made, freed, total, label = peak_of(block_events({**_saved("fp32", 1, 64), "input": bsh}, d,
                                                           input_name="input"))
    # the output LN's input grad, the dropout's grad, output.dense's input grad: 16,384 + 16,384 + 32,768;
    # the weights: the LN's 2·64, output.dense's 64·128 + 64, ·4 B
    assert (work, made, label) == (bsh + bsh + bsf, (2 * 64 + 64 * 128 + 64) * 4, "output.dense weight, bias")
    # freed by then: the output LN's input, mean and rstd (2·64·4), the dropout mask
    assert freed == bsh + 512 + bsh
    assert total == work + made - freed == 65_536 + 33_536 - 33_280


def test_bf16_top_is_the_attention_weights_gradient():
    d = BlockDims(B=1, S=64, H=64, F=128, A=4, act=2, param=2)
    work, _, _, _, label = peak_of(block_events({**_saved("bf16", 1, 64), "input": 8192}, d, input_name="input"))
    # the attention LayerNorm's input grad (waiting for the q/k/v projections' to be summed: 64·64·2), the output
    # grad's fp32 upcast and value_acc's grad (2 · 64·64·4), the weights' grad (4·64·64·4); attention.output.dense's
    # input grad died at the upcast, its reader
    assert (work, label) == (8192 + 2 * 16384 + 65536, "attention weights grad")


def test_amp_bf16_top_and_the_linears_casts():
    d = BlockDims(B=1, S=64, H=64, F=128, A=4, act=2, param=4, norm=4)
    ev = block_events({**_saved("amp-bf16", 1, 64), "input": 0}, d, input_name="input")
    work, made, _, _, label = peak_of(ev)
    # the attention LayerNorm's fp32 input grad (64·64·4), the output grad's fp32 upcast and value_acc's grad
    # (2 · 64·64·4), the weights' grad (4·64·64·4); the 16-bit output grads and weight grads died at their casts
    assert (work, label) == (16384 + 2 * 16384 + 65536, "attention weights grad")
    # every parameter gradient fp32 once its cast's node ran: the layer's 2·(2·64) LayerNorm, 4·(64·64 + 64)
    # attention, (128·64 + 128) + (64·128 + 64) MLP parameters, ·4 B
    assert sum(n for kind, _, n in ev if kind == "grad") == (4 * 64 + 4 * (64 * 64 + 64) + 2 * 128 * 64 + 192) * 4
    # every transient freed by the end but the layer input's fp32 gradient, handed to the layer before: 64·64·4
    assert sum(n for kind, _, n in ev if kind == "work") == 16384


def _cases():
    for head in ("mlm", "seq-cls", "token-cls"):
        for precision in ("fp32", "bf16", "amp-bf16"):
            for recompute in ("none", "full"):
                for batch, seq in ((1, 32), (1, 64), (2, 32), (2, 64)):
                    yield head, precision, recompute, batch, seq


@pytest.mark.slow  # 72 fake-tensor traces
@pytest.mark.parametrize("head,precision,recompute,batch,seq", list(_cases()))
def test_bert_peak_equals_trace(head, precision, recompute, batch, seq):
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    spec, step = replace(spec_from_hf_config(BERT), head=head, num_labels=3), StepSpec(batch=batch, seq=seq,
                                                                                       precision=precision)
    impl = replace(IMPL, recompute=recompute)
    e, t = estimate(spec, step, impl), trace_step(BERT, step, impl, head=head)
    assert e.peak_bytes == t.peak_logical_bytes, (e.peak_phase, t.peak_phase, t.peak_op, t.peak_module)
    if t.peak_phase == "backward" and t.peak_module.startswith("bert.encoder"):
        assert e.peak_phase in ("backward", "backward_first_block")


@pytest.mark.slow
@pytest.mark.parametrize("head,precision,batch", [("seq-cls", "fp32", 1), ("token-cls", "bf16", 1),
                                                  ("seq-cls", "fp32", 2), ("seq-cls", "amp-bf16", 1)])
def test_estimate_equals_a_real_cpu_step(head, precision, batch):
    """A real CPU step (``LiveStorages``), less the optimizer's fp32 step counters (4 bytes per parameter, host
    tensors the trace does not see), == the estimate: the step's top is the last block's output dense (fp32 B1,
    B2) or its attention weights' gradient (bf16; amp-bf16, level with the last LayerNorm's forward moment). Its
    linears' input gradients die at their reader's node."""
    pytest.importorskip("torch")
    from tests.estimate.real_head_step import real_head_step
    from trainmem.estimate import estimate

    step = StepSpec(batch=batch, seq=64, precision=precision)
    real, counters, n_params = real_head_step(BERT, head, step, IMPL)
    assert counters == 4 * n_params
    spec = replace(spec_from_hf_config(BERT), head=head, num_labels=3)
    e = estimate(spec, step, IMPL)
    assert e.peak_bytes == real - counters
    assert {p.name: p.bytes for p in e.phases}["backward"] == e.peak_bytes
