"""``--precision amp-bf16`` (fp32 weights, torch.autocast) with pipeline stages is refused: the stage model
under autocast reads off the real schedule's trace both ways (tiny Llama H64 F176 L4 A4 KV2 V256, B 2 S 64,
AdamW, pp 2, 4 micro-batches, sdpa on CPU, estimate / trace per rank: eager GPipe none 1.078 / 1.090, full
0.884 / 0.950; eager 1F1B none 1.009 / 0.978, full 0.886 / 0.888; compiled block GPipe full -131,072 /
-27,644 B),
while fp32 and bf16 are exact (tests/estimate/test_compiled_pp.py, tests/trace/test_trace_pp*.py)."""

import pytest

from trainmem.cli import main
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.mark.parametrize("precision", ["amp-bf16", "hf-bf16", "amp-fp16"])
@pytest.mark.parametrize("compile_kw", [{}, dict(compile=True, compile_scope="block")], ids=["eager", "compiled"])
def test_autocast_with_pipeline_stages_is_refused(precision, compile_kw):
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", recompute="full", **compile_kw)
    with pytest.raises(UnsupportedError, match=r"precision='amp-(bf|fp)16' is not modelled with pp=2"):
        estimate(spec_from_hf_config(CFG), step, impl, ParallelSpec(pp=2, microbatches=4))


def test_autocast_without_pipeline_stages_and_bf16_with_them_still_estimate():
    model = spec_from_hf_config(CFG)
    impl = ImplSpec(device="cpu", attention="sdpa")
    assert estimate(model, StepSpec(batch=2, seq=64, precision="amp-bf16"), impl, ParallelSpec(dp=2)).peak_bytes > 0
    assert estimate(model, StepSpec(batch=2, seq=64, precision="bf16"), impl,
                    ParallelSpec(pp=2, microbatches=4)).peak_bytes > 0


def test_cli_refusal_is_one_line_exit_2(capsys):
    rc = main(["estimate", "--model", "gpt2", "--batch", "2", "--seq", "64", "--precision", "amp-bf16",
               "--pp", "2", "--microbatches", "4"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "precision='amp-bf16' is not modelled with pp=2" in err


@pytest.mark.slow  # one fake-tensor trace, ~3 s
def test_the_trace_keeps_one_weight_cast_per_stage():
    """The mechanism: the trace runs the schedule under one torch.autocast, whose cast cache keeps a single bf16
    copy of each stage weight for every micro-batch (aten/src/ATen/autocast_mode.cpp cached_casts); the estimate
    would count one per micro-batch in flight (GPipe rank 0: 3 x 2 blocks x 92,160 B = 552,960 B)."""
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision="amp-bf16", optimizer="adamw")
    t = trace_step(CFG, step, ImplSpec(device="cpu", attention="sdpa"), parallel=ParallelSpec(pp=2, microbatches=4),
                   pp_rank=0)
    casts = [x for x in t.alive_at_peak if x.name.endswith("q_proj._to_copy") or ("q_proj._to_copy:" in x.name
                                                                                  and x.shape == (64, 64))]
    assert sorted(x.name for x in casts) == ["model.layers.0.self_attn.q_proj._to_copy",
                                              "model.layers.1.self_attn.q_proj._to_copy"]
