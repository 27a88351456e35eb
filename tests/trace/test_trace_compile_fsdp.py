"""``trace --compile --compile-scope block --dp N --fsdp full``: the real ``fully_shard`` and per-block
``torch.compile`` (partitioned as inductor does, no codegen) as rank 0 of the fake process group.

FSDP2's hooks are ``_dynamo_disable``-d (``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``), so the
all-gather runs eagerly before each compiled block and the region's inputs are the unsharded parameters:
each partitioned region saves exactly what the one-device region saves (names, shapes, dtypes), whichever
order compile and ``fully_shard`` are applied in (the trace's: ``fully_shard`` then ``torch.compile(block)``;
torchtune's: ``block.compile()`` in place, then ``fully_shard``). A torchao NF4 base weight is gathered as its
NF4 storages (``NF4Tensor.fsdp_pre_all_gather``) and enters the compiled region as them: its
dequantization is inside the compiled graph (inductor fuses it), no bf16 weight is made outside.
The estimate against these traces: tests/estimate/test_compiled_fsdp.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")
FSDP2 = ParallelSpec(dp=2, fsdp="full")


@pytest.fixture
def regions(monkeypatch):
    """Every partitioned region's saved values, as ``trace/compiled.py`` reads them off the backward graph."""
    from trainmem.trace import compiled

    seen: list = []
    read = compiled.saved_values

    def record(backward_graph):
        seen.append(read(backward_graph))
        return seen[-1]

    monkeypatch.setattr(compiled, "saved_values", record)
    return seen


@pytest.mark.slow  # two traces with compiled blocks (~25 s each on 2 shared cores)
@pytest.mark.parametrize("precision,one_device", [("fp32", "fp32"), ("fsdp-bf16", "bf16")])
def test_each_compiled_block_saves_what_it_saves_on_one_device(regions, precision, one_device):
    from trainmem.trace import trace_step

    sharded = trace_step(LLAMA, StepSpec(batch=2, seq=64, precision=precision), BLOCK, parallel=FSDP2)
    under_fsdp, regions[:] = list(regions), []
    single = trace_step(LLAMA, StepSpec(batch=2, seq=64, precision=one_device), BLOCK)
    assert under_fsdp == regions and len(regions) == 2  # names, shapes, dtypes, bytes: region by region
    # the unsharded weights are the region's inputs: q_proj 64 x 64, not rank 0's 32 x 64 shard
    assert any(v.shape == (64, 64) for v in under_fsdp[0])
    assert sharded.meta["compile"] == single.meta["compile"]  # the saved sets autograd holds, eager and compiled
    assert sharded.meta["fsdp"]["world_size"] == 2


def _torchtune_order_regions(regions, precision):
    """torchtune's order (recipes/lora_finetune_distributed.py at 30b8519e8: ``training.compile_model``, each
    layer's ``m.compile()`` in place, then ``training.shard_model``'s ``fully_shard``): one real step on CPU."""
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import Compiled, decoder_blocks, partitioning_backend
    from trainmem.trace.parallel_fsdp import apply_fsdp2, fake_world

    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = partitioning_backend(Compiled())
    model = build_hf_model(LLAMA, attention="sdpa")
    for _, _, block in decoder_blocks(model):
        block.compile(backend=backend, dynamic=False)
    with fake_world(2) as mesh:
        apply_fsdp2(model, mesh, FSDP2, StepSpec(batch=2, seq=64, precision=precision))
        ids = torch.randint(0, 256, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
    return list(regions)


@pytest.mark.slow  # one real step and one trace (~30 s)
def test_compiling_before_fully_shard_saves_the_same(regions):
    from trainmem.trace import trace_step

    before = _torchtune_order_regions(regions, "fp32")
    regions[:] = []
    trace_step(LLAMA, StepSpec(batch=2, seq=64, precision="fp32"), BLOCK, parallel=FSDP2)
    assert before == regions


QLORA = dict(LLAMA, hidden_size=256, intermediate_size=512, num_key_value_heads=4)  # to_nf4: multiples of 64·256


@pytest.mark.slow  # QLoRA on torchao NF4 under FSDP2 and compiled, checkpointed blocks (~2 min)
def test_gathered_nf4_weights_are_dequantized_inside_the_compiled_block(regions):
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.trace import trace_step

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ft = FinetuneSpec(mode="qlora", quant_impl="torchao-nf4", lora_targets=targets)
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")
    trace_step(QLORA, StepSpec(batch=2, seq=64, precision="bf16"), impl, parallel=FSDP2, finetune=ft)
    (saved,) = regions  # both blocks share one Dynamo cache entry; checkpointed: the region keeps its inputs
    # each 4-bit weight enters as its gathered NF4 codes, two weights a byte, of the unsharded weight:
    # 4 attention weights 256 x 256 -> 32,768 B, 3 MLP weights 512 x 256 -> 65,536 B (rank 0's shard is half)
    codes = sorted(v.nbytes for v in saved if v.dtype == "uint8" and len(v.shape) == 1 and v.shape[0] >= 32768)
    assert codes == [32768] * 4 + [65536] * 3
    # and no dequantized weight crosses into the region: no bf16 tensor of a weight's size
    assert not [v for v in saved if v.dtype == "bfloat16" and v.nbytes >= 256 * 256 * 2]
