"""``--profile traced`` on an encoder-decoder (T5): two stacks of blocks, each with its own layer
kinds, cut and templates, traced in one run (estimate/traced/kinds.py ``find_stacks``).

S is the encoder's and the decoder's length: the model is run as ``trainmem trace`` runs its
seq2seq head (``trace/step.py`` ``_inputs``: ``labels`` = the input ids, which T5 shifts right
into the decoder's input). Ground truth as in test_traced_profile.py: the bytes autograd saves in a
real CPU forward (``trace/saved.py``), and the step on real CPU tensors (``trace_step(real=True)``).
Tiny configs (d_model 64, B=2, S=32); every test that builds T5 and traces it is slow.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.traced import traced_template, unmapped_model_spec  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402
from trainmem.trace.torch_state import default_dtype  # noqa: E402

B, S = 2, 32
T5 = dict(model_type="t5", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
          vocab_size=512, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)
# kinds per stack: block 0 (relative attention bias), the blocks alike, the last block
DEEP = dict(T5, num_layers=6, num_decoder_layers=5)
STATES = ("parameter", "gradient", "optimizer_state")


pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py


def _estimate(tmp_path, cfg, precision, attention, **impl):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return estimate(unmapped_model_spec(str(path)), StepSpec(batch=B, seq=S, precision=precision),
                    ImplSpec(profile="traced", device="cpu", attention=attention, **impl))


def _autograd_saved(cfg, precision, attention) -> int:
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(cfg, attention=attention)
    ids = torch.randint(2, cfg["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss)
    return sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()  # and the loss held: loss.value


def test_two_stacks_expand_under_their_own_prefixes():
    # a template's JSON round trip and its activations, blocks named by their own stack (no trace)
    from trainmem.estimate.traced import poly as P
    from trainmem.estimate.traced.template import Kind, Template, TracedItem

    pts = list(P.grid_points((8, 16, 24)))
    axes = (P.fit(pts, [b for b, _ in pts]), P.fit(pts, [s for _, s in pts]), P.fit(pts, [64] * len(pts)))
    out = TracedItem.fitted("mlp.out", "mm", "bfloat16", axes, P.fit(pts, [b * s * 64 * 2 for b, s in pts]))
    w = (("wi.weight", (128, 64)),)
    tpl = Template("t5", (("encoder.block.", 3), ("decoder.block.", 2)), (0, None), False, (),
                   (Kind((0, 1, 2), (out,), w, "encoder.block."), Kind((0, 1), (out,), w, "decoder.block.")),
                   (("shared.weight", (512, 64)),), (), {}, 5, tuple(pts))
    assert Template.from_json(json.loads(json.dumps(tpl.to_json()))) == tpl
    acts = tpl.activations(B, S)
    assert sorted(i.name for i in acts) == ["decoder.block.0.mlp.out", "decoder.block.1.mlp.out",
                                            "encoder.block.0.mlp.out", "encoder.block.1.mlp.out",
                                            "encoder.block.2.mlp.out"]
    assert acts.totals()["activation"] == 5 * B * S * 64 * 2  # 5 blocks x 2·32·64·2 = 40,960
    # peak.py counts blocks through the template's two stacks, encoder first (names.stack_block), not
    # T5's inner 'layer' lists
    from trainmem.estimate.peak import layer_stats
    assert layer_stats(acts, tpl.stacks).act_layer == {i: B * S * 64 * 2 for i in range(5)}
    assert tpl.num_parameters() == 512 * 64 + 5 * 128 * 64
    before, kinds, after = tpl.parameter_layout()
    assert [(layers, prefix) for _, layers, prefix in kinds] == [((0, 1, 2), "encoder.block."),
                                                                 ((0, 1), "decoder.block.")]


@pytest.mark.slow  # ~15 s each on two shared cores: a trace at seven (B, S), a real forward, a real step
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_t5_traced_equals_autograd_and_the_real_step(tmp_path, precision, attention):
    e = _estimate(tmp_path, T5, precision, attention)
    assert e.totals_bytes["activation"] == _autograd_saved(T5, precision, attention)
    step = StepSpec(batch=B, seq=S, precision=precision)
    real = trace_step(T5, step, ImplSpec(attention=attention, device="cpu"), real=True)
    # trainmem trace's items: the same parameters, gradients and AdamW states, to the byte
    for cat in STATES:
        assert e.totals_bytes[cat] == sum(i.bytes for i in real.items if i.category.value == cat), cat
    # its activations: the same, less the token ids (the trace's "input"), plus one loss-dtype scalar:
    # the loss's seed gradient (ones_like), which the estimate's phases hold apart (the loss itself is
    # the estimate's loss.value)
    traced_ids = next(i.bytes for i in e.inventory if i.name.endswith(("input_ids", ".indices")))
    trace_acts = sum(i.bytes for i in real.items if i.category.value == "activation")
    assert e.totals_bytes["activation"] - traced_ids == trace_acts - (2 if precision == "bf16" else 4)
    # the step's peak: the trace's peak in blocks of 512 B (its allocator rounds), the estimate in bytes
    assert abs(e.peak_bytes / real.peak_bytes - 1) < 0.01
    assert abs(e.peak_bytes / real.peak_logical_bytes - 1) < 0.01


WIDE = dict(T5, d_model=256, d_ff=512, d_kv=32, num_heads=8)  # B2 S256: the decoder stack's end is the peak


@pytest.mark.slow  # ~60 s each: a trace at d_model 256, S up to 256, and a real step
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_t5_peak_holds_the_decoder_stacks_locals(tmp_path, precision):
    # with a 512-token vocabulary the step's peak is the decoder stack's last op (its final dropout):
    # T5Stack.forward still holds its position biases, input embeddings and the KV cache it returns, and the
    # decoder's input ids the root made (_shift_right's new_zeros, traced/record.py _name_model_ids: named
    # decoder.embed_tokens.model_ids, not loss.new_zeros left out with the head's tensors). Measured: est == real to the
    # byte, fp32 168,503,296 B and bf16 134,665,216 B (was -4,096 B with the ids filed as the loss's; -3,968 B
    # before the buffer ledger read T5's own buffers; -1.6% / -1.4% without the stack_end phase)
    step = StepSpec(batch=B, seq=256, precision=precision)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(WIDE))
    e = estimate(unmapped_model_spec(str(path)), step, ImplSpec(profile="traced", device="cpu", attention="sdpa"))
    real = trace_step(WIDE, step, ImplSpec(attention="sdpa", device="cpu"), real=True)
    assert (e.peak.name, real.peak_phase, real.peak_module) == ("stack_end", "forward", "decoder.dropout")
    assert e.peak_bytes == real.peak_logical_bytes
    ids = next(i for i in e.inventory if i.name == "decoder.embed_tokens.model_ids")
    assert (ids.bytes, ids.dtype) == (B * 256 * 8, "int64")


SMALL = dict(T5, d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_decoder_layers=6, num_heads=8, vocab_size=32128)


@pytest.mark.slow  # ~15 s: t5-small's shape, a fake-tensor trace of the estimate and one of the step
def test_t5_loss_backward_keeps_the_decoders_ids(tmp_path):
    # at a 32k vocabulary the peak is the loss's backward: the decoder's input ids the root made (traced/record.py
    # _name_model_ids) are saved by the decoder's embedding, not the loss's target that NllLossBackward0 releases
    # (measured: est - trace = -16,384 B, B4 S512 int64, while they were named loss.new_zeros)
    step = StepSpec(batch=4, seq=512, precision="fp32")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    e = estimate(unmapped_model_spec(str(path)), step, ImplSpec(profile="traced", device="cpu", attention="sdpa"))
    fake = trace_step(SMALL, step, ImplSpec(attention="sdpa", device="cpu"))
    assert (e.peak.name, fake.peak_phase) == ("backward_start", "backward")
    assert e.peak_bytes == fake.peak_logical_bytes


@pytest.mark.slow  # ~20 s: T5 with 6 + 5 blocks, cut to 4 + 4
def test_t5_stacks_keep_their_own_kinds(tmp_path):
    e = _estimate(tmp_path, DEEP, "bf16", "sdpa")
    assert e.totals_bytes["activation"] == _autograd_saved(DEEP, "bf16", "sdpa")
    tpl = traced_template(DEEP, StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(profile="traced", device="cpu"))
    assert tpl.stacks == (("encoder.block.", 6), ("decoder.block.", 5))
    assert [(k.prefix, k.layers) for k in tpl.kinds] == [
        ("encoder.block.", (0,)), ("encoder.block.", (1, 2, 3, 4)), ("encoder.block.", (5,)),
        ("decoder.block.", (0,)), ("decoder.block.", (1, 2, 3)), ("decoder.block.", (4,))]
    assert tpl.traced_layers == 8  # 4 + 4
    assert tpl.num_parameters() == sum(p.numel() for p in build_hf_model(DEEP).parameters())


@pytest.mark.slow  # ~3 s: one meta build
def test_t5_every_k_is_refused_in_one_line(tmp_path):
    with pytest.raises(UnsupportedError, match=r"^--profile traced: t5 has two stacks .*every-k") as err:
        _estimate(tmp_path, T5, "bf16", "sdpa", recompute="every-k", recompute_every=2)
    assert "\n" not in str(err.value)
