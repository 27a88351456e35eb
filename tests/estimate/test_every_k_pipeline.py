"""``--recompute every-k`` under ``--pp``: each pipeline rank counts its own blocks (``ImplSpec.recompute_counts``).

torchtitan's ``_apply_layer_sac`` (distributed/activation_checkpoint.py) increments a module-level counter per
block ``apply_ac`` wraps, and ``apply_ac`` runs on each model part a rank holds, after the pipeline cut: the count
runs over the rank's own blocks, on across its virtual stages. The estimate places it in its numbering of a rank's
blocks (``estimate/every_k_stages.py`` ``place_every_k``: one run of blocks per rank), the trace in the model's
(``trace/recompute.py`` ``place_every_k_trace``: rank r's global stages r, r + pp, ...)."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.every_k_stages import place_every_k
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.impl import every_k_counts
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace.recompute import place_every_k_trace


def _llama(layers: int) -> dict:
    return dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                tie_word_embeddings=False)


STEP = StepSpec(batch=2, seq=64, precision="fp32", optimizer="adamw")


def _every(k: int, **kw) -> ImplSpec:
    return ImplSpec(device="cpu", attention="sdpa", recompute="every-k", recompute_every=k, **kw)


def _blocks(impl: ImplSpec, layers: int) -> list[int]:
    return [i for i in range(layers) if impl.checkpointed(i)]


def _par(schedule: str = "1f1b", v: int = 1) -> ParallelSpec:
    return ParallelSpec(pp=2, schedule=schedule, microbatches=4, virtual_stages=v)


def test_counts_run_over_each_ranks_blocks():
    # two ranks of 3 blocks: each counts 1, 2, 3 and wraps its 2nd (blocks 1 and 4; the model's count: 1, 3, 5)
    assert every_k_counts([[(0, 3)], [(3, 6)]]) == ((0, 0), (3, 0))
    # interleaved, 2 blocks per virtual stage: rank 0 builds stages 0 and 2 (blocks 0-1, 4-5), counted 0-1, 2-3
    assert every_k_counts([[(0, 2), (4, 6)], [(2, 4), (6, 8)]]) == ((0, 0), (2, 0), (4, 2), (6, 2))
    m6 = spec_from_hf_config(_llama(6))
    assert _blocks(place_every_k(m6, _every(2), _par()), 6) == [1, 4]
    assert _blocks(place_every_k_trace(_every(2), _par(), 6), 6) == [1, 4]
    assert _blocks(_every(2), 6) == [1, 3, 5]
    # k=3 over 8 blocks, interleaved: rank 0's 3rd block is its second stage's first (block 4), rank 1's block 6
    assert _blocks(place_every_k_trace(_every(3), _par("interleaved", 2), 8), 8) == [4, 6]
    # the estimate numbers rank 0's blocks 0-3 and rank 1's 4-7: their 3rd blocks are 2 and 6
    assert _blocks(place_every_k(spec_from_hf_config(_llama(8)), _every(3), _par("interleaved", 2)), 8) == [2, 6]


def test_trace_flags_follow_the_ranks_count():
    """``enable_recompute`` given the ParallelSpec sets transformers' per-layer flags from the rank's count."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from trainmem.trace.recompute import enable_recompute

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_llama(6)))
    enable_recompute(model, _every(2), parallel=_par())
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [i for i, f in enumerate(flags) if f] == [1, 4]


def test_what_the_estimate_refuses():
    """``check_every_k_stages`` (``parallel.validate``) is called here directly where ``rank_classes`` would place the
    count first (a proposed one-line change): a count placed for another layout, or none where the ranks' and the
    model's counts differ, is refused rather than priced on other blocks."""
    from trainmem.estimate.every_k_stages import check_every_k_stages

    m6, m8 = spec_from_hf_config(_llama(6)), spec_from_hf_config(_llama(8))
    placed = place_every_k(m6, _every(2), _par())
    check_every_k_stages(m6, placed, _par())
    with pytest.raises(SpecError, match=r"recompute_counts=\(\(0, 0\), \(3, 0\)\): are not the per-rank count"):
        check_every_k_stages(m6, placed, ParallelSpec(pp=3, microbatches=4))
    with pytest.raises(SpecError, match="recompute_counts=.*: are a pipeline's per-rank count; with pp=1"):
        check_every_k_stages(m6, placed, ParallelSpec(dp=2))
    # unplaced, the model's count (blocks 1, 3, 5) is not the ranks' (1, 4)
    with pytest.raises(SpecError, match=r"recompute_every=2: under pp=2 \(1f1b\) the blocks are counted per rank"):
        check_every_k_stages(m6, _every(2), _par())
    # interleaved, k=3: rank 0 checkpoints its 2nd virtual stage's first block only; the estimate holds the two
    # virtual stages as equal shares of the rank's blocks (6 % under the trace on rank 0, measured)
    with pytest.raises(SpecError, match="recompute_every=3: under pp=2 interleaved with 2 virtual stages"):
        estimate(m8, STEP, place_every_k(m8, _every(3), _par("interleaved", 2)), _par("interleaved", 2))
    # where the counts agree, placed or not, one estimate: L=8, k=2, stages start at 0 and 4
    par = _par()
    assert (estimate(m8, STEP, _every(2), par).peak_bytes
            == estimate(m8, STEP, place_every_k(m8, _every(2), par), par).peak_bytes)


@pytest.mark.slow  # four fake-tensor pipeline traces of the tiny model, ~3 s each
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_estimate_equals_trace_per_stage(schedule):
    """L=6, pp=2, k=2, 4 micro-batches, fp32 B2 S64: each rank checkpoints its 2nd block (blocks 1 and 4, which the
    whole model's count, 1, 3, 5, did not: refused before). Both ranks == trace to the byte (gpipe 7,969,856 and
    9,007,456 B, 1f1b 5,610,560 and 4,991,060 B; the last stage's own position ids, which its checkpointed blocks
    keep, were 512 B per micro-batch short before estimate/parallel.py _own_position_ids)."""
    from trainmem.trace import trace_step

    par = _par(schedule)
    cfg = _llama(6)
    ranks = estimate(spec_from_hf_config(cfg), STEP, place_every_k(spec_from_hf_config(cfg), _every(2), par), par).ranks
    for rank, cls in enumerate(ranks):
        traced = trace_step(cfg, STEP, place_every_k_trace(_every(2), par, 6), parallel=par, pp_rank=rank)
        assert cls.peak_bytes == traced.peak_logical_bytes, (rank, cls.peak_bytes, traced.peak_logical_bytes)


def test_first_counts_the_whole_models_blocks():
    """``recompute_from='first'`` (transformers' ``every_n_layers``): ``_set_gradient_checkpointing`` counts the
    blocks of the model ``activation_checkpointing_enable`` is called on, the whole model before the cut, so every
    rank keeps the model's blocks 0, k, 2k... In the estimate's numbering of an interleaved rank (one run of blocks)
    each virtual stage counts on from its global stage's first block: rank 0 holds stages 0 and 2 (blocks 0-1, 4-5),
    numbered 0-3, so the model's block 4 (k=4) is the estimate's block 2."""
    first = _every(2, recompute_from="first")
    m6, m8 = spec_from_hf_config(_llama(6)), spec_from_hf_config(_llama(8))
    assert _blocks(place_every_k(m6, first, _par()), 6) == _blocks(place_every_k_trace(first, _par(), 6), 6) == [0, 2, 4]
    inter = _par("interleaved", 2)
    assert place_every_k(m8, first, inter).recompute_counts == ((0, 0), (2, 4), (4, 2), (6, 6))
    first4 = _every(4, recompute_from="first")
    assert _blocks(place_every_k_trace(first4, inter, 8), 8) == [0, 4]
    assert _blocks(place_every_k(m8, first4, inter), 8) == [0, 2]
    with pytest.raises(SpecError, match="layer_split=.*--recompute-from first"):
        place_every_k(m8, first4, ParallelSpec(pp=2, schedule="interleaved", microbatches=4, virtual_stages=2,
                                               layer_split=(4, 4)))


@pytest.mark.slow  # four fake-tensor pipeline traces of the tiny model, ~3 s each
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_first_estimate_equals_trace_per_stage(schedule):
    """L=6, pp=2, k=3, recompute_from='first': the model's blocks 0 and 3, each stage's first block (kth would
    checkpoint each rank's 3rd, blocks 2 and 5). Both ranks == trace to the byte (gpipe 7,785,024 and 9,007,456 B,
    1f1b 5,610,560 and 4,991,060 B). Not exact where a non-last stage's last block is checkpointed, kth or first
    alike (k=2 first, block 2: rank 0 0.9934 of the trace; k=3 kth, block 2: 0.9947): a (B, S, H) short."""
    from trainmem.trace import trace_step

    par, cfg, impl = _par(schedule), _llama(6), _every(3, recompute_from="first")
    ranks = estimate(spec_from_hf_config(cfg), STEP, impl, par).ranks
    for rank, cls in enumerate(ranks):
        traced = trace_step(cfg, STEP, impl, parallel=par, pp_rank=rank)
        assert cls.peak_bytes == traced.peak_logical_bytes, (rank, cls.peak_bytes, traced.peak_logical_bytes)


@pytest.mark.slow  # eight fake-tensor pipeline traces of the tiny model, ~3 s each
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("impl", [_every(2, recompute_from="first"), _every(3), ImplSpec(device="cpu", attention="sdpa",
                                                                                         recompute="full")],
                         ids=["first-k2", "kth-k3", "full"])
def test_checkpointed_stage_end_equals_trace(schedule, impl):
    """L=6, pp=2: rank 0's last block (block 2, whose output the stage sends) checkpointed: first k=2 (blocks 0, 2,
    4), kth k=3 (2, 5), full. Both ranks == trace to the byte; rank 0 was one (B, S, H), 32,768 B, under in each
    (1f1b full: 3,700,800 for 3,733,568 B) before backward_moments.py left a checkpointed block out of the received
    gradient's discount."""
    from trainmem.trace import trace_step

    par, cfg = _par(schedule), _llama(6)
    ranks = estimate(spec_from_hf_config(cfg), STEP, impl, par).ranks
    for rank, cls in enumerate(ranks):
        traced = trace_step(cfg, STEP, impl, parallel=par, pp_rank=rank)
        assert cls.peak_bytes == traced.peak_logical_bytes, (rank, cls.peak_bytes, traced.peak_logical_bytes)
