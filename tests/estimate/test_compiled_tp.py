"""``estimate --compile --compile-scope block --tp N --sp`` (estimate/compiled_tp.py): compiled blocks after
DTensor TP with sequence parallelism. A rank keeps the one-device compiled block at its shapes (heads, K/V
heads, FFN width ÷ tp), except that the block input, both norms' rsqrt and o_proj's (reduce-scattered)
output are on its S/tp tokens and each norm's kept output is the all-gathered one. Against the trace and a
real 2-rank gloo step: tests/trace/test_trace_compile_tp.py (slow).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")
# the per-rank shapes tp 2 leaves: heads 2, K/V heads 1, FFN 88, vocabulary 128 (vocab-parallel)
RANK_LLAMA = dict(LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=88,
                  vocab_size=128)
# on S/tp under SP: the block's input (the previous block's output), o_proj's reduce-scattered output, both rsqrt
ON_SEQ_SHARD = {"self_attn.o_proj.out": "self_attn.o_proj.out_sp", "input_layernorm.rsqrt": "input_layernorm.rsqrt",
                "post_attention_layernorm.rsqrt": "post_attention_layernorm.rsqrt", "residual_mlp": "residual_mlp"}


def _activations(result, block: str) -> dict[str, int]:
    return {i.name.removeprefix(block): i.bytes for i in result.inventory.items
            if i.category.value == "activation" and i.name.startswith(block)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_compiled_sp_block_is_the_one_device_block_at_rank_shapes(precision):
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, BLOCK, parallel=ParallelSpec(tp=2, sp=True)).ranks
    one = estimate(spec_from_hf_config(RANK_LLAMA), step, BLOCK)
    for block in ("model.layers.0.", "model.layers.1."):
        expected = {}
        for name, nbytes in _activations(one, block).items():
            if name in ON_SEQ_SHARD:
                expected[ON_SEQ_SHARD[name]] = nbytes // 2
            else:  # each norm's output is kept all-gathered: the one-device B·S·H
                expected[name.replace("layernorm.out", "layernorm.out_gathered")] = nbytes
        assert _activations(rank, block) == expected
    # fp32, per block: 2·(2·32·1·4) rsqrt + 2·(2·64·64·4) gathered norm outputs + q 2·64·32·4 + k, v 2·(2·64·16·4)
    # + SDPA output 2·64·32·4 and lse 2·2·64·4 + o_proj 2·32·64·4 + gate, up, product 3·(2·64·88·4)
    # + the output 2·32·64·4 = 284,160 (one device at the rank's shapes: 317,440)
    if precision == "fp32":
        assert sum(_activations(rank, "model.layers.0.").values()) == 284_160
        assert sum(_activations(one, "model.layers.0.").values()) == 317_440


@pytest.mark.parametrize("change,field", [
    (dict(parallel=ParallelSpec(tp=2)), "sp=False"),
    (dict(impl=replace(BLOCK, recompute="full")), "recompute='full'"),
    (dict(impl=replace(BLOCK, compile_scope="block-loss")), "compile_scope='block-loss'"),
    (dict(impl=replace(BLOCK, compile_scope="model")), "compile_scope='model'"),
    (dict(step=StepSpec(batch=2, seq=64, precision="amp-bf16")), "precision='amp-bf16'"),
])
def test_what_compiled_tp_does_not_model_is_refused(change, field):
    from trainmem.errors import UnsupportedError

    args = dict(step=StepSpec(batch=2, seq=64), impl=BLOCK, parallel=ParallelSpec(tp=2, sp=True), **{})
    args.update(change)
    with pytest.raises(UnsupportedError, match=field.replace("(", r"\(")):
        estimate(spec_from_hf_config(LLAMA), args["step"], args["impl"], parallel=args["parallel"])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fsdp-bf16"])
def test_tp_then_fsdp2_keeps_the_compiled_tp_blocks_and_fsdp2s_states(precision):
    """torchtitan's 2-D layout compiled (apply_tp, apply_compile, apply_fsdp): the compiled TP set beside
    FSDP2's sharded states; fsdp-bf16 saves pure bf16's set (tests/trace/test_trace_compile_2d.py: == trace)."""
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    two_d = ParallelSpec(dp=2, tp=2, sp=True, fsdp="full")
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, BLOCK, parallel=two_d).ranks
    tp_step = replace(step, precision="bf16") if precision == "fsdp-bf16" else step
    tp_alone = estimate(spec_from_hf_config(LLAMA), tp_step, BLOCK, parallel=ParallelSpec(tp=2, sp=True))
    (eager,) = estimate(spec_from_hf_config(LLAMA), step, replace(BLOCK, compile=False, compile_scope="model"), parallel=two_d).ranks
    acts = {i.name: i.bytes for i in rank.inventory.items if i.category.value == "activation"}
    assert acts == {i.name: i.bytes for i in tp_alone.inventory.items if i.category.value == "activation"}
    for ledger in ("parameter", "gradient", "optimizer_state", "buffer"):
        assert rank.totals_bytes[ledger] == eager.totals_bytes[ledger], ledger
    # 2 blocks x 46,080 + embedding and head 2 x 256 x 64 over dp x tp, the 5 norms of 64 over dp: fp32 125,568
    width = 2 if precision == "bf16" else 4
    assert rank.totals_bytes["parameter"] == width * ((2 * 46_080 + 2 * 256 * 64) // 4 + 5 * 64 // 2)


@pytest.mark.parametrize("argv,field", [
    (["--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "2"], "fsdp=hybrid"),
    (["--dp", "2"], "dp=2"),
    (["--cp", "2"], "cp=2"),
])
def test_compiled_tp_beside_another_dimension_is_one_line(capsys, tmp_path, argv, field):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc = main(["estimate", "--model", str(cfg), "--seq", "64", "--device", "cpu", "--compile", "--compile-scope",
               "block", "--tp", "2", "--sp", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "compile" in err and field in err, err
