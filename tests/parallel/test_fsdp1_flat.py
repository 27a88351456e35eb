"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``) flat parameters that mix frozen
and trainable weights (issue 13, mechanism 5), against real gloo runs.

The claim (torch/distributed/fsdp/_flat_param.py, _runtime_utils.py; estimate/fsdp1_flat.py cites the
functions): a unit's FlatParameter holds its frozen and trainable weights together, each padded
to 16 bytes and the whole to a multiple of the world size; the gradient is the whole flat
parameter's, so its shard covers the frozen weights too, while each trainable weight's optimizer
states cover only the part of it in the rank's chunk (ranks differ). FSDP2 shards per parameter
and gives frozen weights no gradient: the same run under ``fully_shard`` is the contrast.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.fsdp1_flat import flat_layout, fsdp1_rank_states  # noqa: E402
from trainmem.estimate.model_states import model_state_items  # noqa: E402
from trainmem.measure_dist.worker import DEFAULTS  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

STEP = StepSpec(batch=DEFAULTS["batch"], seq=DEFAULTS["seq"], precision="fp32", optimizer="adamw")
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
FROZEN = ("self_attn",)  # attention frozen, MLP and norms train: every block's flat parameter mixes both
FT = FinetuneSpec(mode="full", freeze=FROZEN)
MODEL = spec_from_hf_config(DEFAULTS["config"])
LEDGERS = ("parameter", "gradient", "optimizer_state")


@functools.lru_cache(maxsize=None)
def _launch() -> dict:
    from trainmem.measure_dist.launch import run_torchrun_many

    scenarios = [dict(strategy="fsdp1", freeze=list(FROZEN)), dict(strategy="fsdp", freeze=list(FROZEN)),
                 dict(strategy="fsdp1", lora=True)]
    return dict(zip((1, 2, "lora"), run_torchrun_many(2, scenarios, timeout=400)))


def _dist():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_states_exact():
    """Each rank's parameter chunks, FlatParameter gradients and optimizer states, to the byte.
    (peft LoRA is estimated with peft's wrap policy, as HF Trainer wraps it: test_fsdp1_peft.py.)"""
    _dist()
    states = model_state_items(MODEL, STEP, FT, "hf")
    for r in _launch()[1]:
        mine = fsdp1_rank_states(states, world=2, rank=r["rank"])
        got = {k: sum(i.bytes for i in mine if i.category.value == k) for k in LEDGERS}
        measured = {**{k: r["states_bytes"][k] for k in LEDGERS}, "gradient": r["fsdp1_flat_grad_bytes"]}
        assert got == measured, r["rank"]


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_rank_without_adapters_still_holds_a_gradient():
    """peft LoRA under FSDP1 wrapped per block only (not HF Trainer's wrapping, which gives the
    adapters units of their own: test_fsdp1_peft.py): rank 1's chunks hold only frozen weights (the
    adapters sit in the first half of each block), so no original parameter has a gradient there,
    yet the FlatParameters' gradients (reduce-scattered for every rank) are allocated: the whole
    chunk, as on rank 0."""
    _dist()
    r0, r1 = _launch()["lora"]
    assert r1["states_bytes"]["gradient"] == 0 and r1["states_bytes"]["optimizer_state"] == 0
    assert r1["fsdp1_flat_grad_bytes"] == r0["fsdp1_flat_grad_bytes"] == r0["states_bytes"]["gradient"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("version", [1, 2])
def test_estimate_is_the_fullest_rank(version):
    """The estimate's rank class holds the most: FSDP1's parameter and gradient chunks equal on
    every rank, optimizer states the largest rank's; FSDP2 per-parameter shards on every rank."""
    _dist()
    est = estimate(MODEL, STEP, IMPL, parallel=ParallelSpec(dp=2, fsdp="full", fsdp_version=version), finetune=FT)
    (cls,) = est.ranks
    runs = _launch()[version]
    for k in LEDGERS:
        assert cls.totals_bytes.get(k, 0) == max(r["states_bytes"][k] for r in runs), k
    if version == 1:  # the frozen attention's gradient: FSDP1's gradient shard is its parameter shard
        assert cls.totals_bytes["gradient"] == cls.totals_bytes["parameter"]
    else:
        assert cls.totals_bytes["gradient"] < cls.totals_bytes["parameter"]


def test_flat_layout_pads_like_flat_param_handle():
    # 16-byte alignment of every start (4 fp32 elements), then the total to a multiple of the world
    assert flat_layout([3, 5, 4], world=4, align=4) == ([0, 4, 12], 16)
    assert flat_layout([3, 5, 4], world=3, align=4) == ([0, 4, 12], 18)
    assert flat_layout([3, 5], world=4, align=0) == ([0, 3], 8)  # use_orig_params=False: no padding added


def test_refused_where_fsdp1_cannot_run():
    # FlatParameter needs one dtype: QLoRA's 4-bit storage beside the 16-bit norms (peft's fp32
    # adapters on a bf16 base run: their own units, tests/parallel/test_fsdp1_peft.py)
    with pytest.raises(SpecError, match="fsdp_version=1: .*QLoRA under FSDP1"):
        estimate(MODEL, StepSpec(batch=1, seq=16, precision="bf16", optimizer="adamw"), IMPL,
                 parallel=ParallelSpec(dp=2, fsdp="full", fsdp_version=1), finetune=FinetuneSpec(mode="qlora"))
    with pytest.raises(SpecError, match="fsdp_version"):  # torch.distributed.pipelining drives FSDP2 only
        estimate(MODEL, STEP, IMPL, parallel=ParallelSpec(dp=2, pp=2, fsdp="full", fsdp_version=1))
    with pytest.raises(SpecError, match="fsdp_version"):
        ParallelSpec(dp=2, fsdp_version=1)


def test_hf_args_version_1(tmp_path):
    """TrainingArguments' fsdp_config version 1 (training_args.py _process_fsdp_args; accelerate's
    key fsdp_version) selects FSDP1; use_orig_params=false is refused (not modelled)."""
    import json

    from trainmem.errors import ConfigError
    from trainmem.inputs import read_hf_args

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1}}))
    assert read_hf_args(str(path))["overrides"]["parallel"]["fsdp_version"] == 1
    path.write_text(json.dumps({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 1, "use_orig_params": False}}))
    with pytest.raises(ConfigError, match="use_orig_params=False"):
        read_hf_args(str(path))
    path.write_text(json.dumps({"fsdp": "full_shard"}))
    assert "fsdp_version" not in read_hf_args(str(path))["overrides"]["parallel"]  # FSDP2, the default


def test_advise_reproduces_fsdp1():
    """plan/advise print the estimate line of a configuration: FSDP1 stays FSDP1 in it."""
    from trainmem.plan.choices import Config

    par = ParallelSpec(dp=8, fsdp="full", fsdp_version=1)
    assert "--fsdp full --fsdp-version 1" in Config(STEP, IMPL, par).command("llama-3-8b")
    assert "--fsdp-version" not in Config(STEP, IMPL, ParallelSpec(dp=8, fsdp="full")).command("llama-3-8b")
