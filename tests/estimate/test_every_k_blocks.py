"""Which blocks ``--recompute every-k`` checkpoints (``ImplSpec.checkpointed``, ``recompute_from``).

torchtitan (``distributed/activation_checkpoint.py`` ``_apply_layer_sac``) and torchtune
(``training/activations.py`` ``checkpoint_wrapper``) increment a counter before testing
``count % k == 0``: the k-th, 2k-th... block is wrapped (0-based k-1, 2k-1, ...), floor(L/k) blocks, none when
k > L. transformers' ``every_n_layers`` (``PreTrainedModel._set_gradient_checkpointing``) tests
``layer_index % k == 0``: blocks 0, k, 2k. Before, trainmem checkpointed blocks 0, k, 2k for every source."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA3 = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
STEP = StepSpec(batch=2, seq=96, precision="fp32", optimizer="adamw")


def _every(k: int, start: str = "kth") -> ImplSpec:
    return ImplSpec(attention="sdpa", device="cpu", recompute="every-k", recompute_every=k, recompute_from=start)


@pytest.mark.parametrize("k,start,blocks", [(2, "kth", [1]), (3, "kth", [2]), (4, "kth", []), (1, "kth", [0, 1, 2]),
                                            (2, "first", [0, 2]), (4, "first", [0])])
def test_checkpointed_blocks(k, start, blocks):
    assert [i for i in range(3) if _every(k, start).checkpointed(i)] == blocks


def test_recompute_from_is_validated():
    with pytest.raises(SpecError, match="recompute_from"):
        _every(2, "last")


def test_step_time_share_counts_floor_l_over_k():
    """plan/cost.py recomputes the checkpointed share of the blocks: at L=3, k=2 one block (torchtitan), not two."""
    from trainmem.plan.cost import step_time
    from trainmem.plan.hardware import load_gpu
    from trainmem.specs import ParallelSpec

    model = spec_from_hf_config(LLAMA3)
    times = {k: step_time(model, STEP, _every(k), ParallelSpec(), load_gpu("h100-80gb"), global_batch=8).compute_s
             for k in (1, 2, 4)}
    none = step_time(model, STEP, ImplSpec(attention="sdpa", device="cpu"), ParallelSpec(), load_gpu("h100-80gb"),
                     global_batch=8).compute_s
    assert times[4] == none  # k > L: nothing recomputed
    assert times[2] - none == pytest.approx((times[1] - none) / 3)


@pytest.mark.slow  # builds the tiny model and two fake-tensor traces, ~3-6 s
@pytest.mark.parametrize("k,blocks", [(2, [1]), (4, [])])
def test_trace_flags_and_estimate_equal_trace(k, blocks):
    """The trace checkpoints the same blocks (trace/recompute.py sets HF's per-layer flags from
    ``checkpointed``), and the estimate equals it: L=3, k=2 checkpoints block 1 only; k=4 > L none (HF's
    checkpointing still turns the KV cache off, in the estimate too). fp32 B2 S96: at B1 S32 the optimizer step is
    the top, 256 B apart at L=3 whatever the recompute (not every-k's)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from trainmem.trace import trace_step
    from trainmem.trace.recompute import enable_recompute

    cfg = dict(LLAMA3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    enable_recompute(model, _every(k))
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [i for i, f in enumerate(flags) if f] == blocks
    t = trace_step(LLAMA3, STEP, _every(k))
    e = estimate(spec_from_hf_config(LLAMA3), STEP, _every(k))
    assert e.peak_bytes == t.peak_logical_bytes
    if not blocks:  # nothing checkpointed: the step is the plain one (5,280,840 B both)
        assert e.peak_bytes == estimate(spec_from_hf_config(LLAMA3), STEP,
                                        ImplSpec(attention="sdpa", device="cpu")).peak_bytes
    else:  # block 1's MLP backward, its recomputation beside block 0's saved set (4,433,224 B both; the ends'
        assert (t.peak_module, e.peak_phase) == ("model.layers.1.mlp", "backward")  # moments read 90,112 B under)


def test_pipeline_stages_count_their_own_blocks():
    """torchtitan counts each rank's blocks (estimate/every_k_stages.py): L=8, pp=2, k=2 (stages start at 0 and 4)
    checkpoints the blocks the whole-model count does; L=6, pp=2, k=4: each rank counts its 3 blocks and wraps none
    (the whole model's count would wrap block 3), so every rank's peak is recompute none's (8,769,600 and
    6,066,508 B; tests/estimate/test_every_k_pipeline.py checks the ranks' count against the trace)."""
    from trainmem.specs import ParallelSpec

    def run(layers, k, recompute="every-k"):
        cfg = {**LLAMA3, "num_hidden_layers": layers}
        return estimate(spec_from_hf_config(cfg), STEP, ImplSpec(recompute=recompute, recompute_every=k),
                        ParallelSpec(pp=2, microbatches=2))

    assert run(8, 2).peak_bytes > 0
    assert [r.peak_bytes for r in run(6, 4).ranks] == [r.peak_bytes for r in run(6, 1, "none").ranks]


@pytest.mark.slow  # one fake-tensor trace each, ~2-4 s
@pytest.mark.parametrize("family,precision,batch,seq", [("llama", "amp-bf16", 1, 32), ("gpt_neox", "bf16", 2, 64)])
def test_lora_every_two_equals_trace(family, precision, batch, seq):
    """LoRA on every adapted linear, k=2 at L=2: block 1 (the last) is the checkpointed one, its recomputation the
    step's top beside block 0's saved set: tiny Llama amp-bf16 B1 S32 1,085,256 B, tiny GPT-NeoX bf16 B2 S64
    3,199,528 B, estimate and trace (block 0 checkpointed, transformers' count: test_recompute_stop.py)."""
    pytest.importorskip("torch")
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.trace import trace_step

    cfg = {"llama": dict(LLAMA3, num_hidden_layers=2),
           "gpt_neox": dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)}[family]
    targets = {"llama": ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
               "gpt_neox": ("query_key_value", "dense_h_to_4h", "dense_4h_to_h")}[family]
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=targets)
    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw")
    t = trace_step(cfg, step, _every(2), finetune=ft)
    e = estimate(spec_from_hf_config(cfg), step, _every(2), finetune=ft)
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)
    assert ".layers.1." in t.peak_module
