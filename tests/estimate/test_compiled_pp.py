"""``estimate --compile --compile-scope block(-loss) --pp N``: compiled blocks on pipeline stages (estimate/compiled_sharded.py).

torchtitan cuts the model into stage models first (``pipeline_llama``) and then runs ``parallelize_fn`` on
each, whose ``apply_compile`` compiles every block of the stage (torchtitan/models/llama3/infra/parallelize.py);
the schedule calls the stage model, so each block is its own compiled region with the one-device block's
inputs. A stage therefore keeps, per micro-batch in flight, the one-device compiled saved set of its own
blocks (the estimate's rules_compiled items), and the schedule's buffers are unchanged. Exact (==) here:
the stage's block items against the one-device compiled estimate's, by name. Against the real schedule with
compiled stages in the fake process group: tests/trace/test_trace_pp_compile.py (slow).
"""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.names import layer_index
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")


def _blocks(items, layers: range) -> dict[str, int]:
    return {i.name: i.bytes for i in items if i.category.value == "activation" and layer_index(i.name) in layers}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("precision,recompute", [("fp32", "none"), ("bf16", "full")])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_stage_keeps_the_one_device_compiled_set_of_its_blocks(schedule, precision, recompute, dp):
    model = spec_from_hf_config(LLAMA)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute=recompute)
    par = ParallelSpec(pp=2, schedule=schedule, microbatches=4, dp=dp, fsdp="full" if dp > 1 else None)
    one = _blocks(estimate(model, step, impl).inventory, range(LLAMA["num_hidden_layers"]))
    seen: dict[str, int] = {}
    for rank in estimate(model, step, impl, parallel=par).ranks:
        first, end = rank.layers
        own = _blocks(rank.inventory, range(end))
        assert own and own.keys().isdisjoint(seen)
        for name, nbytes in own.items():
            # a block input goes with the block that saves it; the next stage's is its receive buffer
            # (estimate/parallel_pp.py recv_input_aliases: 0 B, counted once as pp_recv_activations)
            assert nbytes == (0 if layer_index(name) < first else one[name]), name
        seen.update(own)
    assert seen.keys() == one.keys()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_compiled_loss_saves_the_output_chunk_on_the_last_stage(precision):
    """``--compile-scope block-loss`` (torchtitan's default ``components = ["model", "loss"]``): the compiled
    loss's saved set goes to the last stage, its saved logits (B·S·V) as the schedule's output chunk, counted
    once in ``buffers.pp_output_chunks`` (estimate/parallel_pp.py output_chunk_aliases); the other stage keeps
    what it keeps under ``--compile-scope block``."""
    model = spec_from_hf_config(LLAMA)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    par = ParallelSpec(pp=2, schedule="1f1b", microbatches=4)
    impl = dict(device="cpu", attention="sdpa", compile=True)
    one = {i.name: i for i in estimate(model, step, ImplSpec(**impl, compile_scope="block-loss")).inventory
           if i.category.value == "activation"}
    acts = [{i.name: i.bytes for i in r.inventory if i.category.value == "activation"}
            for r in estimate(model, step, ImplSpec(**impl, compile_scope="block-loss"), parallel=par).ranks]
    block = [{i.name: i.bytes for i in r.inventory if i.category.value == "activation"}
             for r in estimate(model, step, ImplSpec(**impl, compile_scope="block"), parallel=par).ranks]
    loss = {k: v.bytes for k, v in one.items() if k.startswith("loss.")}
    logits = 2 * 64 * 256 * (4 if precision == "fp32" else 2)  # B·S·V in the logits' dtype
    assert one["lm_head.out"].bytes == logits and acts[1]["lm_head.out"] == 0
    assert acts[0] == block[0]
    assert acts[1] == {**{k: v for k, v in block[1].items() if not k.startswith("loss.")}, "lm_head.out": 0, **loss}
    chunks = [i.bytes for i in estimate(model, step, ImplSpec(**impl, compile_scope="block-loss"), parallel=par)
              .ranks[1].inventory if i.name == "buffers.pp_output_chunks"]
    assert chunks == [4 * logits]  # 4 micro-batches' logits, once


@pytest.mark.parametrize("argv,field", [
    (["--compile-scope", "model"], "compile_scope='model'"),
    (["--compile-scope", "block", "--schedule", "interleaved", "--virtual-stages", "2"], "schedule='interleaved'"),
    (["--compile-scope", "block", "--schedule", "zero-bubble"], "schedule='zero-bubble'"),
])
def test_compiled_stages_not_traced_are_refused_in_one_line(capsys, tmp_path, argv, field):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc = main(["estimate", "--model", str(cfg), "--seq", "64", "--device", "cpu", "--compile", "--pp", "2",
               "--microbatches", "4", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "compile" in err and field in err, err
