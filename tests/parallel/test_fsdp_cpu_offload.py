"""FSDP's CPU offload (``--fsdp full --offload params``; estimate/fsdp_offload.py cites torch's source):
every sharded parameter, gradient and optimizer state on the host, the device holding the
gathered parameters, the gradient buffers and the activations.

The real run (slow): 2 gloo ranks, a tiny Llama ``fully_shard``-ed per block and at the root with
``CPUOffloadPolicy(pin_memory=False)`` (tests/parallel/fsdp_offload_worker.py). A CPU run has no
second device, so the check is by what FSDP holds each live storage as: the host kinds equal the
host figure to the byte, the gathered parameters (unsharded + flat all-gather buffers) peak at the
estimate's gathered terms to the byte, and everything but the host kinds peaks at the estimate's
device figure less the two copies that only exist with a separate device, to the byte (FSDP2's
per-tensor timeline, estimate/fsdp_timeline.py). A fourth
step under torchtune's activation offload policy (trainmem/trace/offload.py) leaves on the device,
and copies to the host, the estimate's per-rank activation figures to the byte.
"""

from __future__ import annotations

import functools

import pytest
from torchrun_scripts import launch

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.measure_dist.worker import DEFAULT_CONFIG
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

B, S = 2, 64
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
HOST_LEDGERS = ("parameter", "gradient", "optimizer_state", "master_weight")
# the tiny Llama (H=64, F=176, kv 2 of 4 heads, V=256, untied): a block's and the root's parameters
BLOCK = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64  # 46,208
ROOT = 2 * 256 * 64 + 64  # 32,832: embedding, lm_head, final norm
HEAD = 256 * 64 + 64  # the root's parameters whose gradients exist before the blocks' backward


def _step(precision: str) -> StepSpec:
    return StepSpec(batch=B, seq=S, precision=precision, optimizer="adamw")


def _rank(precision: str = "fp32", offload=("params",), **par):
    par = {"dp": 2, "fsdp": "full", **par}
    est = estimate(spec_from_hf_config(DEFAULT_CONFIG), _step(precision), IMPL,
                   ParallelSpec(offload=offload, **par))
    return est.ranks[0]


def _parts(rank) -> dict[str, dict[str, int]]:
    return {p.name: dict(p.parts) for p in rank.phases}


@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_every_sharded_state_is_a_host_figure(precision):
    on, off = _rank(precision), _rank(precision, offload=())
    assert on.host_bytes == sum(off.totals_bytes.get(k, 0) for k in HOST_LEDGERS) > 0
    assert all(on.totals_bytes.get(k, 0) == 0 for k in HOST_LEDGERS)
    # CPUOffloadPolicy cannot keep the optimizer on the device: naming it changes nothing
    both = _rank(precision, offload=("optimizer", "params"))
    assert (both.host_bytes, both.peak_bytes) == (on.host_bytes, on.peak_bytes)
    assert _parts(on)["optimizer"].get("optimizer_temporaries", 0) == 0  # the step runs on the CPU


def test_device_terms_by_formula():
    fp32, bf16 = _parts(_rank("fp32")), _parts(_rank("fsdp-bf16"))
    for parts, gathered in ((fp32, 4), (bf16, 2)):
        # the root's shard is on the host: the device holds the whole unsharded root
        assert parts["forward"]["fsdp_root_unsharded"] == ROOT * gathered
        assert parts["backward"]["fsdp_allgather"] == 2 * BLOCK * gathered
        # unsharded gradients are made in param_dtype (FSDP2's timeline counts them as autograd's, estimate/
        # fsdp_timeline.py); the root's are reduced at the end of backward, every sharded one is on the host
        assert parts["backward_end"]["gradients"] == ROOT * gathered
        assert parts["optimizer"]["gradients"] == 0
        assert "fsdp_root_unsharded_grads" not in parts["backward"]
        # the reduce-scatter output shard (fp32 reduce) before its copy to the host
        assert parts["backward"]["fsdp_offload_d2h"] == BLOCK * 4 // 2
    # the fp32 shard copied to the device before the all-gather, and its bf16 cast
    assert fp32["forward"]["fsdp_offload_h2d"] == BLOCK * 4 // 2
    assert bf16["forward"]["fsdp_offload_h2d"] == BLOCK * 4 // 2 + BLOCK * 2 // 2


def test_zero3_param_offload_unchanged():
    """DeepSpeed ZeRO-3's offload_param moves the parameters only (its gradients are not FSDP's)."""
    z3 = estimate(spec_from_hf_config(DEFAULT_CONFIG), _step("fp32"), IMPL,
                  ParallelSpec(dp=2, zero=3, offload=("params",))).ranks[0]
    assert z3.totals_bytes["gradient"] > 0 and z3.totals_bytes["parameter"] == 0
    with pytest.raises(SpecError, match="offload"):
        ParallelSpec(dp=2, fsdp="full", offload=("cpu",))


@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_activation_offload_per_rank_is_the_single_device_split(precision):
    """--offload activations with FSDP (torchtune's distributed recipe): each rank's saved
    activations split as one device's would (estimate/activation_offload.py), beside FSDP's terms."""
    from trainmem.estimate.activation_offload import activation_offload

    split = activation_offload(spec_from_hf_config(DEFAULT_CONFIG), _step(precision), IMPL)
    acts, both, states = (_rank(precision, offload=o) for o in (("activations",), ("activations", "params"), ("params",)))
    assert acts.totals_bytes["activation"] == both.totals_bytes["activation"] == split.device.total()
    assert both.host_bytes - states.host_bytes == acts.host_bytes == split.host_bytes
    backward = _parts(both)["backward"]
    assert backward["offload_in_flight"] == split.in_flight_bytes and "fsdp_offload_d2h" in backward
    assert _parts(acts)["forward"]["offload_stash"] == split.stash_bytes
    assert both.peak_bytes < states.peak_bytes


# --- the real run -------------------------------------------------------------------------------

SCENARIOS = {"fp32": {}, "fsdp-bf16": {"bf16": True}}


@functools.lru_cache(maxsize=None)
def _launch() -> dict[str, list[dict]]:
    return launch("fsdp_offload_worker.py", {k: dict(config=DEFAULT_CONFIG, batch=B, seq=S, **sc)
                                             for k, sc in SCENARIOS.items()})


@pytest.mark.slow  # one torchrun launch, 30-70 s on 2 shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("precision", list(SCENARIOS))
def test_live_set_by_kind_matches_a_real_cpu_offload_run(precision):
    pytest.importorskip("torch.distributed.fsdp")
    rank, acts = _rank(precision), _rank(precision, offload=("activations", "params"))
    parts = _parts(rank)
    gathered = max(p.get("fsdp_root_unsharded", 0) + p.get("fsdp_allgather", 0) for p in parts.values())
    # the copies to and from a separate device do not exist when the device is the CPU
    cpu_device = max(p.bytes - p.parts.get("fsdp_offload_h2d", 0) - p.parts.get("fsdp_offload_d2h", 0)
                     for p in rank.phases)
    for r in _launch()[precision]:
        assert r["on_cpu"]  # CPUOffloadPolicy put every shard on the CPU
        most = r["most"]
        # host: the sharded parameters, their gradients at the end of backward, AdamW's two states
        host = (most["backward"]["host_params"] + most["backward"]["host_grads"] + r["host_optimizer_bytes"])
        assert rank.host_bytes == host, (rank.host_bytes, host, r)
        assert gathered == max(m["gathered"] for m in most.values()), (gathered, most)
        device = max(m["device"] for m in most.values())
        assert cpu_device == device, (cpu_device, device, r["at_device_peak"])
        # a fourth step under torchtune's activation offload: kept on the device, copied to the host
        assert (r["act_offload_kept"], r["act_offload_host"]) == (acts.totals_bytes["activation"],
                                                                  acts.host_bytes - rank.host_bytes)


def test_torchtune_distributed_recipe_with_both_offloads(tmp_path):
    """full_finetune_distributed.py: shard_model(cpu_offload=fsdp_cpu_offload) and the activation
    offloading context around the sharded model's forward, both read from one recipe."""
    from trainmem.inputs import read_torchtune

    p = tmp_path / "full.yaml"
    p.write_text("model:\n  _component_: torchtune.models.llama2.llama2_7b\ndtype: bf16\nbatch_size: 2\n"
                 "enable_activation_checkpointing: True\nenable_activation_offloading: True\n"
                 "fsdp_cpu_offload: True\ndata_parallel_shard_dim: 8\n")
    par = read_torchtune(p)["overrides"]["parallel"]
    assert par == {"fsdp": "full", "dp": 8, "offload": ("optimizer", "params", "activations")}
    p.write_text(p.read_text() + "tensor_parallel_dim: 2\n")  # TP ranks split the activations: not composed
    assert "activations" not in read_torchtune(p)["overrides"]["parallel"]["offload"]


def test_advise_offers_it_and_the_clock_prices_it():
    """plan/choices.py's fsdp_cpu_offload (only where FSDP shards) and plan/cost.py's price: the
    shards to the device for each all-gather, the gradient shards to the host, the CPU Adam."""
    from trainmem.plan.choices import CHOICES, Config, Context
    from trainmem.plan.cost import step_time
    from trainmem.plan.hardware import load_gpu
    from trainmem.specs.loaders import load_model

    model, step, impl = load_model("llama-3-8b"), StepSpec(batch=1, seq=2048, precision="bf16"), ImplSpec()
    ctx = Context(model, 8, 8, fp8=False)
    fsdp = Config(step, impl, ParallelSpec(dp=8, fsdp="full"))
    [(offloaded, _)] = CHOICES["fsdp_cpu_offload"].variants(fsdp, ctx)
    assert offloaded.par.offload == ("params",)
    assert "--offload params" in offloaded.command("llama-3-8b")
    assert not list(CHOICES["fsdp_cpu_offload"].variants(Config(step, impl, ParallelSpec(dp=8, zero=3)), ctx))
    gpu = load_gpu("h100-80gb")
    plain, off = (step_time(model, step, impl, c.par, gpu, global_batch=8).offload_s for c in (fsdp, offloaded))
    assert plain == 0 < off
