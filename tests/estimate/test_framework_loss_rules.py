"""``--loss torchtune-chunked-ce`` / ``litgpt-chunked-ce`` (trainmem/estimate/losses.py): the rules as
exact integers, and the estimate's loss phases against the tracer running the frameworks' loss code
on fake tensors (trainmem/trace/losses.py; that trace equals a real CPU step and torchtune's own class:
tests/trace/test_trace_framework_losses.py).

torchtune's ``ignore_labels_cache`` (B int64, made at setup) is in both under torchtune's loss (estimate/
torchtune_loop.py, a buffer item); the tracer makes it for LitGPT's loss too, whose loop has none, so it is added
to the estimate there (the model's buffers, rotary ``inv_freq``, are in both: estimate/buffers.py).
"""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.losses import chunk_lengths, framework_loss_phases
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
IMPL = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="fused")


def test_chunk_lengths():
    assert chunk_lengths("torchtune-chunked-ce", 64) == [8] * 8
    assert chunk_lengths("torchtune-chunked-ce", 250) == [32] * 7 + [26]  # torch.chunk: ceil(250/8) each
    assert chunk_lengths("torchtune-chunked-ce", 5) == [1] * 5  # fewer chunks than asked
    assert chunk_lengths("litgpt-chunked-ce", 200) == [128, 72]


def test_torchtune_rule_bytes():
    p = framework_loss_phases("torchtune-chunked-ce", B=2, S=64, V=1000, logits_dtype="bfloat16")
    # every chunk's bf16 logits 2·64·1000·2 = 256000; the last chunk's fp32 upcast (2·8 rows)·1000·4 = 64000;
    # hstack's shifted labels 2·64·8 = 1024 (their chunks were copied); the running sum + last loss 8
    assert p.forward == {"logits": 256000, "logits_upcast_chunk": 64000, "labels": 1024, "loss_scalars": 8}
    # newest chunk first (j=7): 2 fp32 chunk tensors 8·16·1000 = 128000, all 8 log-softmax 4·1000·128 =
    # 512000, the labels (7·128) and total weights (7·4) of chunks 0-6, 3 fp32 scalars (12) = 640936, less
    # what the activations count (log-softmax 512000 + labels 1024 + 8 weights 32 + count 8 + the loss
    # value 4 = 513068)
    assert p.backward_start == {"logits_grad": 640936 - 513068}
    assert p.held == 0
    assert p.head_backward is None  # no trainable head weight given
    # with one (V·H·2 = 1000·64·2 = 128000): the second chunk matmul's backward holds both chunks' weight
    # gradients and their sum (3·128000), the logit gradients of chunks 0-5 (6·16·1000·2 = 192000) and the
    # loss + seed (8); from B=2 the two input-gradient chunks replace the two chunk copies freed
    h = framework_loss_phases("torchtune-chunked-ce", B=2, S=64, V=1000, logits_dtype="bfloat16",
                              hidden_row_bytes=64 * 2, head_weight_grad=128000)
    assert h.head_backward == {"logits_grad": 192000, "head_weight_grads": 384000, "loss_scalars": 8}
    one = framework_loss_phases("torchtune-chunked-ce", B=1, S=64, V=1000, logits_dtype="bfloat16",
                                hidden_row_bytes=64 * 2, head_weight_grad=128000)
    assert one.head_backward["hidden_grads"] == 64 * 2 * (8 + 8)  # B=1: h's views stay, 2 chunk gradients
    fp32 = framework_loss_phases("torchtune-chunked-ce", B=1, S=64, V=1000, logits_dtype="float32")
    assert fp32.forward == {"logits": 256000, "loss_scalars": 8}  # .float() of fp32 is the tensor itself


def test_litgpt_rule_bytes():
    p = framework_loss_phases("litgpt-chunked-ce", B=2, S=200, V=1000, logits_dtype="bfloat16")
    # chunks of 128 and 72 positions; the last drops one: rows 256 and 142
    assert p.held == 2 * 200 * 1000 * 2  # the loop's logits: 800000, in every phase
    # reshape copies the sliced last chunk (142·1000·2 = 284000); cat + the row losses 2·398·2 = 1592
    assert p.forward == {"logits_copy": 284000, "row_losses": 1592}
    # j=0 (the larger chunk, last to run): its two bf16 tensors 2·2·256·1000 = 1024000, its log-softmax
    # 512000, chunk 1's logit gradient 284000, loss + seed 4 = 1820004, less the kept 796000 (log-softmax)
    # + 3184 (targets 2·199·8) + 4 (2 total weights in the logits' dtype, bf16) + 8 (count) + 2 (the bf16
    # loss value)
    assert p.backward_start == {"logits_grad": 1820004 - 799198}


@pytest.mark.parametrize("kwargs,field", [
    (dict(precision="amp-bf16"), "precision"),
    (dict(seq=1, loss="litgpt-chunked-ce"), "seq"),
])
def test_refusals_name_the_field(kwargs, field):
    step = StepSpec(**{"batch": 1, "seq": 64, "loss": "torchtune-chunked-ce", **kwargs})
    with pytest.raises(SpecError) as err:
        estimate(spec_from_hf_config(CFG), step, IMPL)
    assert err.value.field == field


def test_other_profiles_are_refused():
    with pytest.raises(SpecError) as err:
        estimate(spec_from_hf_config(CFG), StepSpec(batch=1, seq=64, loss="litgpt-chunked-ce"),
                 ImplSpec(profile="reference"))
    assert err.value.field == "loss"


def test_tensor_parallel_logits_are_refused():
    model = spec_from_hf_config({**CFG, "num_attention_heads": 4, "num_key_value_heads": 4})
    with pytest.raises(SpecError, match="unsharded logits"):
        estimate(model, StepSpec(batch=1, seq=64, loss="torchtune-chunked-ce"), IMPL, parallel=ParallelSpec(tp=2))


def test_chunked_losses_lower_the_bf16_peak_on_a_large_vocabulary():
    model = spec_from_hf_config({**CFG, "vocab_size": 128256})
    peaks = {loss: estimate(model, StepSpec(batch=2, seq=2048, precision="bf16", loss=loss), IMPL).peak_bytes
             for loss in ("ce", "torchtune-chunked-ce", "litgpt-chunked-ce")}
    assert peaks["litgpt-chunked-ce"] < peaks["torchtune-chunked-ce"] < peaks["ce"]


# estimate == trace, phase by phase -------------------------------------------------------------------

def _phase_top(result, phase: str) -> int:
    """Most logical bytes alive while the trace is in ``phase``."""
    rec = result.recording
    marks: dict[int, list[str]] = {}
    for i, name in rec.marks:
        marks.setdefault(i, []).append(name)
    live = top = 0
    current = None
    for i, e in enumerate(rec.events):
        for current in marks.get(i, ()):
            pass
        live += rec.blocks[e].nbytes if e >= 0 else -rec.blocks[~e].nbytes
        if current == phase:
            top = max(top, live)
    return top


@pytest.mark.slow
@pytest.mark.parametrize("loss,precision,B,S,H,V", [
    # a hidden state wide against the vocabulary: the head's backward (weight gradients summed) is the top
    ("torchtune-chunked-ce", "bf16", 1, 256, 512, 1000),
    ("torchtune-chunked-ce", "fp32", 2, 256, 512, 1000),
    ("litgpt-chunked-ce", "bf16", 1, 512, 256, 4000),
])
def test_head_backward_peak_equals_trace(loss, precision, B, S, H, V):
    from trainmem.trace import trace_step

    cfg = {**CFG, "hidden_size": H, "intermediate_size": 2 * H, "vocab_size": V}
    step = StepSpec(batch=B, seq=S, precision=precision, loss=loss)
    t = trace_step(cfg, step, IMPL)
    e = estimate(spec_from_hf_config(cfg), step, IMPL)
    extra = _litgpt_ignore_labels(t, loss)
    assert e.peak_phase == "head_backward"
    assert t.peak_logical_bytes == e.peak_bytes + extra


@pytest.mark.slow
@pytest.mark.parametrize("family,S", [("llama", 200), ("qwen2", 250)])
@pytest.mark.parametrize("precision,B", [("fp32", 2), ("bf16", 1), ("bf16", 2)])
@pytest.mark.parametrize("loss", ["torchtune-chunked-ce", "litgpt-chunked-ce"])
def test_estimate_equals_trace(loss, precision, B, family, S):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    cfg = {**CFG, "model_type": family}
    step = StepSpec(batch=B, seq=S, precision=precision, loss=loss)
    t = trace_step(cfg, step, IMPL)
    e = estimate(spec_from_hf_config(cfg), step, IMPL)
    extra = _litgpt_ignore_labels(t, loss)  # the ignore-labels column; the ids and the buffers are in both
    ph = {p.name: p.bytes + extra for p in e.phases}
    assert t.peak_logical_bytes == e.peak_bytes + extra, (e.peak_phase, t.peak_logical_bytes - e.peak_bytes - extra)
    assert _phase_top(t, "backward") == ph["backward_start"]  # the loss backward is the backward's top
    if loss == "torchtune-chunked-ce":
        assert _phase_top(t, "forward") == ph["forward"]
    else:  # the scalars around LitGPT's last sum and division differ by a few bytes; backward is its peak
        assert abs(_phase_top(t, "forward") - ph["forward"]) <= 8
        assert e.peak_phase == "backward_start"


def _litgpt_ignore_labels(t, loss: str) -> int:
    """The (B, 1) ignore-labels column the tracer makes for either framework loss (trace/step.py): torchtune's
    loop keeps it (in the estimate: estimate/torchtune_loop.py), LitGPT's has none (not in the estimate)."""
    return 0 if loss == "torchtune-chunked-ce" else sum(
        i.bytes for i in t.items if i.category is Category.INPUT and i.name != "input.0")
