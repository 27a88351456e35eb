"""``--compile`` with ``--cp``: why it is refused (estimate/compiled_cp.py), pinned on torch 2.13, CPU."""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

torch = pytest.importorskip("torch")

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=256, attn_implementation="sdpa")
COMPILED = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")


@pytest.mark.parametrize("par", [ParallelSpec(cp=2), ParallelSpec(cp=2, dp=2, fsdp="full")])
def test_compiled_cp_refused_with_its_reason(par):
    with pytest.raises(UnsupportedError, match=r"compile: cp=2 is not modelled: torch 2.13's context_parallel has "
                                               r"no CPU SDPA .*estimate/compiled_cp.py\)$"):
        estimate(spec_from_hf_config(TINY), StepSpec(batch=1, seq=64, precision="bf16"), COMPILED, par)


def test_torch_context_parallel_has_no_cpu_sdpa():
    """torch's own CP (the public context_parallel) refuses SDPA's CPU kernel: nothing to trace on CPU."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel

    from trainmem.trace.parallel_fsdp import fake_world

    q = torch.randn(1, 4, 32, 16)
    with fake_world(2) as mesh, context_parallel(mesh, buffers=[torch.arange(64)[None]], buffer_seq_dims=[1]):
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu.default does not "
                                                      "have a sharding strategy registered"):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _block_saved(cp: int, seq: int, full: bool = False) -> list:
    """The saved values of one compiled tiny Llama block (bf16, fake tensors, rank 0 of ``cp``): torch's own
    ``context_parallel`` over the ids when cp > 1, with CUDA's flash op standing in for SDPA
    (tests/parallel/cp_flash_standin.py), one device with the same op at S/cp else; ``full``: checkpointed
    inside the compiled region, as torchtitan's apply_ac then apply_compile."""
    import contextlib

    from cp_flash_standin import flash_sdpa
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainmem.trace.compiled import Compiled, partitioning_backend
    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.parallel_fsdp import fake_world

    torch._dynamo.reset()
    record = Compiled()
    backend = partitioning_backend(record)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, torch_dtype=torch.bfloat16)
    old = torch.get_default_dtype()
    with fake_world(max(cp, 2)) as mesh, FakeTensorMode(), masks_as_on_real_tensors(), flash_sdpa():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(cfg)
            layers = model.model.layers
            block = checkpoint_wrapper(layers[0]) if full else layers[0]
            layers[0] = torch.compile(block, backend=backend, dynamic=False, fullgraph=True)  # whole: no break
            ids = torch.randint(0, 128, (1, seq))  # cut to the rank's S/cp in place by context_parallel
            with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]) if cp > 1 else contextlib.nullcontext():
                assert ids.shape == (1, seq // cp)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        finally:
            torch.set_default_dtype(old)
    (region,) = record.regions
    return [v for v in region if not v.name.startswith("primals_") or v.name == "primals_1"]  # no weights


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_compiled_block_under_cp_keeps_the_gathered_kv(cp, monkeypatch):
    """The finding behind the refusal: beyond the one-device compiled set at S/cp, the block keeps the other
    ranks' K/V chunks (views of the all-gather output, which backward does not issue again) and a contiguous
    copy of the merged attention output."""
    seq, hidden, kv_heads, head_dim, b = 64, 64, 4, 16, 2
    graphs = _partitions_kept(monkeypatch)
    ring = _block_saved(cp, seq)
    (forward, backward), = graphs
    assert [_collectives(g) for g in (forward, backward)] == [["all_gather_into_tensor"], ["all_to_all_single"] * cp]
    alone = _block_saved(1, seq // cp)
    s = seq // cp
    kv_chunk = kv_heads * s * head_dim * b  # (1, Akv, S/cp, hd) bf16; the rank's own q, k, v are in both sets
    chunks = [v for v in ring if v.shape == (1, kv_heads, s, head_dim) and v.name.startswith("view_")]
    assert len(chunks) == 2 * (cp - 1) and all(v.nbytes == kv_chunk for v in chunks)
    # cp 2: 4,096 + 2·4,096 = 12,288 B; cp 4: 2,048 + 6·2,048 = 14,336 B
    assert sum(v.nbytes for v in ring) - sum(v.nbytes for v in alone) == s * hidden * b + 2 * (cp - 1) * kv_chunk


@pytest.mark.slow
def test_checkpointed_compiled_block_under_cp_keeps_its_input(monkeypatch):
    """--recompute full (torchtitan's long-context runs): the checkpointed block keeps what one device's does at
    S/cp, its input (no K/V: the all-gather is issued again when backward recomputes the block), and one
    generator state per SDPA call of the ring (rng ops in a checkpointed region: partitioners.py
    functionalize_rng_ops; the CPU generator's 5,056 B here), one per ring step instead of one."""
    graphs = _partitions_kept(monkeypatch)
    ring = _block_saved(2, 64, full=True)
    (forward, backward), = graphs
    assert [_collectives(g) for g in (forward, backward)] == [["all_gather_into_tensor"],
                                                              ["all_gather_into_tensor", "all_to_all_single",
                                                               "all_to_all_single"]]
    alone = _block_saved(1, 32, full=True)
    states = [v for v in ring if v.dtype == "uint8"]
    assert [(v.name, v.shape) for v in ring if v.dtype != "uint8"] == [("primals_1", (1, 32, 64))]
    assert len(states) == 2 and sum(v.nbytes for v in ring) - sum(v.nbytes for v in alone) == states[1].nbytes


def _collectives(graph) -> list[str]:
    """The functional collectives a partitioned graph issues, in order (their waits left out)."""
    names = [str(n.target).split(".")[1] for n in graph.graph.nodes
             if n.op == "call_function" and str(n.target).startswith("_c10d_functional.")]
    return [n for n in names if n != "wait_tensor"]


def _partitions_kept(monkeypatch) -> list:
    """Every ``(forward, backward)`` pair inductor's partition_fn returns (partitioning_backend calls it) while
    the test runs."""
    import torch._inductor.compile_fx as compile_fx

    graphs, partition = [], compile_fx.partition_fn

    def kept(*args, **kwargs):
        graphs.append(partition(*args, **kwargs))
        return graphs[-1]

    monkeypatch.setattr(compile_fx, "partition_fn", kept)
    return graphs
