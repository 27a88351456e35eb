"""FSDP2 unit layout (``--fsdp-units blocks+embed+head``; estimate/fsdp_units.py cites torch's,
torchtune's and torchtitan's source): the token embedding and the final norm + output layer as
their own ``fully_shard`` units, gathered only around their forward and backward.

The real run (slow): 2 gloo ranks, a tiny Llama with a large vocabulary (V=2048, so the head
outweighs a block) ``fully_shard``-ed as torchtitan's ``apply_fsdp`` does it
(tests/parallel/fsdp_units_worker.py); the gathered parameters (unsharded parameters and flat
all-gather buffers) peak per phase at the estimate's figure to the byte.
"""

from __future__ import annotations

import functools
import json

import pytest
from torchrun_scripts import launch

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.measure_dist.worker import DEFAULT_CONFIG
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

B, S, V = 2, 64, 2048
CONFIG = {**DEFAULT_CONFIG, "vocab_size": V}
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
BLOCK = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64  # 46,208 elements
EMBED = V * 64
HEAD = V * 64 + 64  # output layer + final norm: one unit under torchtitan
SEPARATE = "blocks+embed+head"


def _parts(units: str, precision: str = "fp32", **par) -> dict[str, dict[str, int]]:
    rank = estimate(spec_from_hf_config(CONFIG), StepSpec(batch=B, seq=S, precision=precision, optimizer="adamw"),
                    IMPL, ParallelSpec(dp=2, fsdp="full", fsdp_units=units, **par)).ranks[0]
    return {p.name: dict(p.parts) for p in rank.phases}


def _gathered(units: str, precision: str = "fp32", **par) -> dict[str, int]:
    return {n: p.get("fsdp_root_unsharded", 0) + p.get("fsdp_allgather", 0)
            for n, p in _parts(units, precision, **par).items()}


@pytest.mark.parametrize("precision,el", [("fp32", 4), ("fsdp-bf16", 2)])
def test_units_by_formula(precision, el):
    g = _gathered(SEPARATE, precision)
    # the head's forward holds its gathered parameters and its flat all-gather buffer (freed at the
    # next all-gather); its backward those and then the last block's prefetched buffer; the blocks
    # two at a time; the first block's backward prefetches the embedding, whose backward is the last
    assert g["forward"] == g["backward_start"] == 2 * HEAD * el
    assert g["backward"] == (BLOCK + EMBED) * el > 2 * BLOCK * el
    assert g["backward_end"] == 2 * EMBED * el
    # each unit's unsharded gradients (fp32 here) reduce-scattered right after its own backward
    rs = _parts(SEPARATE, precision)
    assert rs["backward_start"]["fsdp_reduce_scatter"] == HEAD * 4
    assert rs["backward_end"]["fsdp_reduce_scatter"] == EMBED * 4
    # under CPU offload no root gradient waits for the end of backward (estimate/fsdp_offload.py)
    off = _parts(SEPARATE, precision, offload=("params",))
    assert off["backward"].get("fsdp_root_unsharded_grads", 0) == off["backward_end"].get("fsdp_root_unsharded_grads", 0) == 0
    # the root holds nothing: CPU offload leaves the gathered terms as they are
    assert _gathered(SEPARATE, precision, offload=("params",)) == g
    # blocks: the root (embedding, norm, head) gathered whole all step, beside the rank's own shard
    # (FSDPParam.init_all_gather_outputs allocates numel × world; estimate/parallel_buffers.py)
    root = (EMBED + HEAD) * el
    assert _gathered("blocks", precision)["backward"] == root + 2 * BLOCK * el


def test_spec_and_readers(tmp_path, capsys):
    from trainmem.cli import main
    from trainmem.inputs import read_torchtitan, read_torchtune

    with pytest.raises(SpecError, match="fsdp_units"):
        ParallelSpec(dp=2, zero=3, fsdp_units=SEPARATE)  # FSDP2's units only
    with pytest.raises(SpecError, match="fsdp_units"):
        ParallelSpec(dp=2, fsdp="full", fsdp_units="embed")
    # torchtune/training/_distributed.py shard_model: custom_sharded_layers (its 70B configs)
    p = tmp_path / "full.yaml"
    p.write_text("model:\n  _component_: torchtune.models.llama3_1.llama3_1_70b\ndtype: bf16\nbatch_size: 2\n"
                 "custom_sharded_layers: ['tok_embeddings', 'output']\ndata_parallel_shard_dim: 8\n")
    assert read_torchtune(p)["overrides"]["parallel"]["fsdp_units"] == SEPARATE
    p.write_text(p.read_text().replace("['tok_embeddings', 'output']", "['output']"))
    assert "fsdp_units" not in read_torchtune(p)["overrides"]["parallel"]
    # torchtitan's apply_fsdp always wraps them
    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\ndata_parallel_shard_degree = 8\n")
    assert read_torchtitan(job)["overrides"]["parallel"]["fsdp_units"] == SEPARATE
    args = ["estimate", "--model", "llama-3-8b", "--batch", "1", "--seq", "2048", "--dp", "8", "--fsdp", "full",
            "--json"]
    assert main(args) == 0
    blocks = json.loads(capsys.readouterr().out)
    assert main(args + ["--fsdp-units", SEPARATE]) == 0
    separate = json.loads(capsys.readouterr().out)
    assert separate["inputs"]["parallel"]["fsdp_units"] == SEPARATE
    assert separate["peak_bytes"] != blocks["peak_bytes"]  # the terms by formula: test_units_by_formula
    assert main(["estimate", "--model", "llama-3-8b", "--fsdp-units", SEPARATE]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "fsdp_units" in err


# --- the real run -------------------------------------------------------------------------------

SCENARIOS = {(u, p): dict(units=u, bf16=p == "fsdp-bf16") for u in ("blocks", SEPARATE) for p in ("fp32", "fsdp-bf16")}


@functools.lru_cache(maxsize=None)
def _launch() -> dict:
    return launch("fsdp_units_worker.py", {k: dict(config=CONFIG, batch=B, seq=S, **sc) for k, sc in SCENARIOS.items()})


@pytest.mark.slow  # one torchrun launch, ~60 s on 2 shared cores
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_gathered_parameters_match_a_real_run(precision):
    pytest.importorskip("torch.distributed.fsdp")
    # CPU offload in the worker tells the shards from the gathered copies (the root's whole size)
    sep, blocks = _gathered(SEPARATE, precision), _gathered("blocks", precision, offload=("params",))
    for r in _launch()[(SEPARATE, precision)]:
        assert r["most"]["forward"] == sep["forward"], r
        assert r["most"]["backward"] == max(sep["backward_start"], sep["backward"], sep["backward_end"]), r
    for r in _launch()[("blocks", precision)]:
        assert r["most"]["backward"] == blocks["backward"], r
    # the real saving in backward: the root's embedding and head, gathered all step, gone
    assert min(r["most"]["backward"] for r in _launch()[("blocks", precision)]) > max(
        r["most"]["backward"] for r in _launch()[(SEPARATE, precision)])
