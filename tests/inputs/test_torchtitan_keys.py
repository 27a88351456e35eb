"""Each torchtitan key -> the spec field it sets, as torchtitan runs it (issue 12, item 2).

Citations are to pytorch/torchtitan at 238fa99 (the last version that read TOML job configs)
unless a comment names an older one.
"""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.errors import ConfigError
from trainmem.inputs import read_torchtitan


def read(tmp_path, text: str) -> dict:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return read_torchtitan(p)


def overrides(tmp_path, text: str) -> dict:
    return read(tmp_path, text)["overrides"]


# [training] mixed_precision_param ------------------------------------------------------------

@pytest.mark.parametrize("parallelism, precision", [
    # torchtitan/models/llama3/infra/parallelize.py, apply_fsdp: fully_shard(mp_policy=
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); torchtitan/distributed/utils.py,
    # maybe_enable_amp: no autocast when FSDP is on
    ("data_parallel_shard_degree = 4", "fsdp-bf16"),
    ("data_parallel_shard_degree = -1", "fsdp-bf16"),  # the leftover ranks (ParallelDims._validate)
    # torchtitan/distributed/parallel_dims.py, ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1
    ("data_parallel_shard_degree = 1\ncontext_parallel_degree = 2", "fsdp-bf16"),
    # maybe_enable_amp: DDP or one device -> torch.autocast(dtype=bfloat16)
    ("data_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 4", "amp-bf16"),
    ("data_parallel_shard_degree = 1", "amp-bf16"),
    # maybe_enable_amp: TP or PP without FSDP -> "Mixed precision training is disabled"
    ("data_parallel_shard_degree = 1\ntensor_parallel_degree = 2", "fp32"),
    ("data_parallel_shard_degree = 1\npipeline_parallel_degree = 2", "fp32"),
])
def test_mixed_precision_param_bfloat16(tmp_path, parallelism, precision):
    out = overrides(tmp_path, f'[training]\nmixed_precision_param = "bfloat16"\n[parallelism]\n{parallelism}\n')
    assert out["step"]["precision"] == precision


def test_mixed_precision_param_default_and_older_place(tmp_path):
    # job_config.py, Training.mixed_precision_param defaults to "bfloat16"; older configs had it in [parallelism]
    assert overrides(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 8\n")["step"]["precision"] == "fsdp-bf16"
    out = read(tmp_path, '[parallelism]\ndata_parallel_shard_degree = 8\nmixed_precision_param = "float32"\n')
    assert out["overrides"]["step"]["precision"] == "fp32"
    assert out["raw"]["parallelism.mixed_precision_param"] == "float32"


def test_training_dtype_bfloat16_is_pure_bf16(tmp_path):
    # job_config.py, Training.dtype: bf16 parameters, gradients and optimizer states, no fp32 copy
    out = overrides(tmp_path, '[training]\ndtype = "bfloat16"\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    assert out["step"]["precision"] == "bf16"


# [parallelism] fsdp_reshard_after_forward --------------------------------------------------

@pytest.mark.parametrize("policy, pp, reshard", [
    # parallelize.py, apply_fsdp: "default" -> reshard_after_forward = not pp_enabled
    (None, 1, True), (None, 2, False), ("default", 4, False),
    ("always", 2, True), ("never", 1, False),
])
def test_reshard_after_forward(tmp_path, policy, pp, reshard):
    line = f'fsdp_reshard_after_forward = "{policy}"\n' if policy else ""
    out = overrides(tmp_path, f"[training]\nlocal_batch_size = 8\n[parallelism]\ndata_parallel_shard_degree = 2\n"
                              f"pipeline_parallel_degree = {pp}\n{line}")
    assert out["parallel"]["reshard_after_forward"] is reshard
    assert out["parallel"]["fsdp"] == "full"


def test_no_fsdp_no_reshard_field(tmp_path):
    out = overrides(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 2\n")
    assert out["parallel"] == {"dp": 2}


# pipeline micro-batches ----------------------------------------------------------------------

@pytest.mark.parametrize("text, batch, microbatches", [
    # torchtitan/distributed/pipeline_parallel.py, build_pipeline_schedule: n_microbatches =
    # local_batch_size // pipeline_parallel_microbatch_size, whose default is 1 (Parallelism)
    ("[training]\nlocal_batch_size = 8\n[parallelism]\npipeline_parallel_degree = 2\n", 1, 8),
    ("[training]\nlocal_batch_size = 8\n[parallelism]\npipeline_parallel_degree = 2\n"
     "pipeline_parallel_microbatch_size = 2\n", 2, 4),
    # before #1073 (torchtitan 5e2033c~1, torchtitan/distributed/pipeline.py, build_pipeline_schedule):
    # batch_size split into pipeline_parallel_microbatches, by default pp degree × stages per rank
    ("[training]\nbatch_size = 8\n[parallelism]\npipeline_parallel_degree = 4\n", 2, 4),
    ("[training]\nbatch_size = 8\n[parallelism]\npipeline_parallel_degree = 4\n"
     "pipeline_parallel_microbatches = 8\n", 1, 8),
    ("[training]\nbatch_size = 8\n[parallelism]\npipeline_parallel_degree = 2\n"
     'pipeline_parallel_schedule = "Interleaved1F1B"\n', 2, 4),  # 2 ranks × 2 stages each
    # no pipeline: the whole local batch is one forward
    ("[training]\nlocal_batch_size = 8\n", 8, None),
])
def test_pipeline_microbatches(tmp_path, text, batch, microbatches):
    out = overrides(tmp_path, text)
    assert out["step"]["batch"] == batch
    assert out.get("parallel", {}).get("microbatches") == microbatches


@pytest.mark.parametrize("text, needle", [
    ("[training]\nlocal_batch_size = 6\n[parallelism]\npipeline_parallel_degree = 2\n"
     "pipeline_parallel_microbatch_size = 4\n", "local_batch_size=6 must be divisible by pipeline_parallel_microbatch_size=4"),
    ("[training]\nbatch_size = 6\n[parallelism]\npipeline_parallel_degree = 4\n",
     "batch_size=6 must be divisible by pipeline_parallel_microbatches=4"),
    ("[training]\nglobal_batch_size = 12\nlocal_batch_size = 4\n[parallelism]\ndata_parallel_shard_degree = 2\n",
     "global_batch_size=12 must be a multiple of local_batch_size × data-parallel degree = 8"),
    ('[parallelism]\nfsdp_reshard_after_forward = "sometimes"\n', "fsdp_reshard_after_forward='sometimes'"),
    ('[training]\nmixed_precision_param = "float8"\n', "mixed_precision_param='float8'"),
    ('[training]\ndtype = "float16"\n', "dtype='float16'"),
])
def test_errors_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        read(tmp_path, text)
    assert needle in str(exc.value)


def test_cli_error_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "job.toml"
    p.write_text("[training]\nlocal_batch_size = 6\n[parallelism]\npipeline_parallel_degree = 2\n"
                 "pipeline_parallel_microbatch_size = 4\n")
    assert main(["estimate", "--torchtitan", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pipeline_parallel_microbatch_size=4" in err


# [training] global_batch_size, [activation_checkpoint], defaults ------------------------------

def test_global_batch_size_is_gradient_accumulation(tmp_path):
    # torchtitan/train.py, Trainer.__init__: global // (local_batch_size × dp_replicate × dp_shard)
    out = overrides(tmp_path, "[training]\nlocal_batch_size = 2\nglobal_batch_size = 64\n"
                              "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4\n")
    assert out["step"]["grad_accum"] == 4  # 64 // (2 × 2 × 4)


@pytest.mark.parametrize("section, recompute", [
    # job_config.py, ActivationCheckpoint: mode "selective", selective_ac_option "2"
    ("", {"recompute": "every-k", "recompute_every": 2}),
    ('[activation_checkpoint]\nmode = "selective"\n', {"recompute": "every-k", "recompute_every": 2}),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n', {"recompute": "op"}),
    ('[activation_checkpoint]\nmode = "none"\n', {"recompute": "none"}),
    # _apply_layer_sac: `not ac_freq or _layer_sac_count % ac_freq == 0`: "0" and "1" wrap every block
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "0"\n', {"recompute": "full"}),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "1"\n', {"recompute": "full"}),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = 3\n',
     {"recompute": "every-k", "recompute_every": 3}),
])
def test_activation_checkpoint(tmp_path, section, recompute):
    assert overrides(tmp_path, section)["impl"] == recompute


def test_defaults_are_torchtitans_and_noted(tmp_path):
    out = read(tmp_path, "[job]\ndescription = 'empty'\n")
    # job_config.py: local_batch_size 8, seq_len 2048, AdamW; dp_shard -1 -> FSDP, bf16 param_dtype
    assert out["overrides"]["step"] == {"batch": 8, "seq": 2048, "optimizer": "adamw", "precision": "fsdp-bf16",
                                        "grad_accum": 1}
    assert out["overrides"]["parallel"] == {"fsdp": "full", "reshard_after_forward": True,
                                            "fsdp_units": "blocks+embed+head"}  # apply_fsdp's units
    assert out["raw"] == {}  # the file gave no key that changes memory
    notes = " ".join(out["notes"])
    assert "local_batch_size=8" in notes and "mixed_precision_param='bfloat16'" in notes and "-1" in notes


# a 3D job through the estimate command ---------------------------------------------------------

def test_3d_job_estimate(tmp_path, capsys):
    p = tmp_path / "job.toml"
    p.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\nseq_len = 4096\n'
                 '[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\n'
                 'pipeline_parallel_degree = 2\n[activation_checkpoint]\nmode = "full"\n')
    assert main(["estimate", "--torchtitan", str(p), "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert {k: inputs["step"][k] for k in ("batch", "seq", "precision")} == \
        {"batch": 1, "seq": 4096, "precision": "fsdp-bf16"}
    par = inputs["parallel"]
    assert (par["dp"], par["tp"], par["sp"], par["pp"], par["microbatches"], par["fsdp"],
            par["reshard_after_forward"]) == (2, 2, True, 2, 8, "full", False)
    # the command line still wins over the file
    assert main(["estimate", "--torchtitan", str(p), "--precision", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["step"]["precision"] == "bf16"


def test_cpu_offload_and_compile(tmp_path):
    # parallelize.py, apply_fsdp(cpu_offload=...): CPUOffloadPolicy, only where FSDP is applied
    out = read(tmp_path, "[training]\nenable_cpu_offload = true\n[parallelism]\ndata_parallel_shard_degree = 4\n"
                         "[compile]\nenable = true\n")
    assert out["overrides"]["parallel"]["offload"] == ("optimizer", "params")
    notes = " ".join(out["notes"])
    assert "CPUOffloadPolicy" in notes and "[compile] enable" in notes
    out = overrides(tmp_path, "[training]\nenable_cpu_offload = true\n[parallelism]\ndata_parallel_shard_degree = 1\n")
    assert "offload" not in out.get("parallel", {})


@pytest.mark.parametrize("section", ['[float8]\nrecipe_name = "rowwise"\n',
                                     '[quantize.linear.float8]\nrecipe_name = "rowwise"\n'])
def test_a_float8_table_without_the_converter_is_a_note(tmp_path, section):
    """torchtitan converts only what [model] converters lists (build_model_converters): the table
    alone converts nothing. It was dropped without a word."""
    out = read(tmp_path, section)
    assert "float8" not in out["overrides"].get("impl", {})
    assert any(n.startswith('a [float8] table without "float8" in [model] converters') for n in out["notes"])
