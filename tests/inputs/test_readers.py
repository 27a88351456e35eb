"""Each input format parsed into exact overrides; malformed and hostile files fail in one line."""

from __future__ import annotations

import json

import pytest

from trainmem.errors import ConfigError
from trainmem.inputs import parse_megatron_args, read_config, read_deepspeed, read_torchtitan


def write(tmp_path, name: str, text: str | bytes):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


# trainmem TOML -----------------------------------------------------------------------------------

def test_trainmem_toml_exact(tmp_path):
    p = write(tmp_path, "run.toml", """
[model]
name = "gpt2"
num_layers = 4
[step]
batch = 2
seq = 512
precision = "mixed-bf16"
[impl]
attention = "eager"
fused_norm = true
[parallel]
tp = 2
sp = true
offload = ["optimizer"]
""")
    out = read_config(p)
    assert out["source"] == "config" and out["path"] == str(p)
    assert out["overrides"] == {
        "model": {"name": "gpt2", "num_layers": 4},
        "step": {"batch": 2, "seq": 512, "precision": "mixed-bf16"},
        "impl": {"attention": "eager", "fused_norm": True},
        "parallel": {"tp": 2, "sp": True, "offload": ("optimizer",)},
    }
    assert out["raw"]["step"]["batch"] == 2


@pytest.mark.parametrize("text, needle", [
    ("[stepp]\nbatch = 1\n", "unknown key 'stepp' (did you mean 'step'?)"),
    ("[step]\nbacth = 1\n", "[step]: unknown key 'bacth' (did you mean 'batch'?)"),
    ("[impl]\nflash = true\n", "unknown key 'flash'"),
    ("batch = 1\n", "unknown key 'batch'"),
    ("step = 3\n", "step must be a table"),
    ("[step]\nbatch = \"two\"\n", "batch='two' must be an int"),
    ("[step]\nbatch = true\n", "batch=True must be an int"),
    ("[parallel]\nsp = 1\n", "sp=1 must be a bool"),
    ("[step]\nbatch = 1\n[step", "invalid TOML"),
    ("[step]\nbatch = ", "invalid TOML"),
    ("a = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
])
def test_trainmem_toml_errors_name_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        read_config(write(tmp_path, "bad.toml", text))
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_hostile_files(tmp_path):
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_config(write(tmp_path, "bin.toml", b"\xff\xfe\x00garbage"))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        read_config(write(tmp_path, "big.toml", "# x\n" * 300_000))
    with pytest.raises(ConfigError, match="is a folder"):
        read_config(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_deepspeed(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="nested too deeply|invalid JSON"):
        read_deepspeed(write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000))


# DeepSpeed ---------------------------------------------------------------------------------------

def test_deepspeed_exact(tmp_path):
    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "none"}, "overlap_comm": True},
           "steps_per_print": 10}
    out = read_deepspeed(write(tmp_path, "ds.json", json.dumps(cfg)))
    # dp = 64 / (4 × 2) = 8
    assert out["overrides"] == {
        "step": {"batch": 4, "grad_accum": 2, "precision": "mixed-bf16", "optimizer": "adamw"},
        "parallel": {"dp": 8, "zero": 3, "offload": ("optimizer",)},
    }
    assert out["raw"] == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                          "train_batch_size": 64, "zero_optimization.stage": 3,
                          "zero_optimization.offload_optimizer.device": "cpu",
                          "zero_optimization.offload_param.device": "none", "bf16.enabled": True,
                          "optimizer.type": "AdamW"}


def test_deepspeed_auto_and_defaults(tmp_path):
    out = read_deepspeed(write(tmp_path, "ds.json", json.dumps(
        {"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}})))
    assert out["overrides"] == {"parallel": {"zero": 2}}
    assert any("auto" in n for n in out["notes"])
    # neither bf16 nor fp16: DeepSpeed trains in fp32
    assert read_deepspeed(write(tmp_path, "d2.json", "{}"))["overrides"] == {"step": {"precision": "fp32"}}
    assert read_deepspeed(write(tmp_path, "d3.json", '{"fp16": {"enabled": true}}'))["overrides"]["step"] == {
        "precision": "mixed-fp16"}


@pytest.mark.parametrize("cfg, needle", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage='3' must be int"),
    ({"zero_optimization": [1]}, "zero_optimization must be an object"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0 must be positive"),
    ({"train_micro_batch_size_per_gpu": 3, "train_batch_size": 10}, "not a multiple"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes' must be bool"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "must be cpu, nvme or none"),
])
def test_deepspeed_errors(tmp_path, cfg, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        read_deepspeed(write(tmp_path, "ds.json", json.dumps(cfg)))
    assert needle in str(exc.value)


def test_deepspeed_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match="expected a JSON object, got a list"):
        read_deepspeed(write(tmp_path, "ds.json", "[1, 2]"))
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        read_deepspeed(write(tmp_path, "ds.json", '{"bf16": {"enabled": tr'))


# Megatron ----------------------------------------------------------------------------------------

LLAMA_ARGS = """
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
    --num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --vocab-size 128256
    --micro-batch-size 1 --global-batch-size 512 --seq-length=8192 --bf16 --use-flash-attn
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --sequence-parallel
    --recompute-granularity selective --use-distributed-optimizer
    --lr 3e-4 --data-path "/data/my corpus" --log-interval 1 --no-masked-softmax-fusion  # a comment
"""


def test_megatron_exact():
    out = parse_megatron_args(LLAMA_ARGS)
    assert out["overrides"] == {
        "model": {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "ffn_size": 14336, "vocab_size": 128256,
                  "family": "generic", "activation": "swiglu", "norm": "rmsnorm", "qkv_bias": False,
                  "out_bias": False, "mlp_bias": False, "norm_bias": False, "qk_norm": False,
                  "tied_embeddings": False, "attn_dropout": 0.0, "hidden_dropout": 0.0, "embd_dropout": 0.0,
                  "num_kv_heads": 8, "max_positions": 0},
        "step": {"batch": 1, "seq": 8192, "precision": "mixed-bf16"},
        "impl": {"attention": "flash", "recompute": "selective"},
        "parallel": {"tp": 4, "pp": 2, "sp": True, "zero": 1},
    }
    assert out["raw"]["ignored"] == ["--lr", "--data-path", "--log-interval", "--no-masked-softmax-fusion"]
    assert out["raw"]["--global-batch-size"] == 512
    assert any("--global-batch-size" in n for n in out["notes"])


def test_megatron_defaults_and_recompute():
    # Megatron's defaults: biases, tied embeddings, dropout 0.1, LayerNorm, GELU, FFN 4h, learned positions
    out = parse_megatron_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
                              "--recompute-granularity full --recompute-method block --recompute-num-layers 1 "
                              "--num-layers-per-virtual-pipeline-stage 1 --pipeline-model-parallel-size 2")
    m = out["overrides"]["model"]
    assert (m["activation"], m["norm"], m["ffn_size"], m["qkv_bias"], m["tied_embeddings"], m["attn_dropout"],
            m["max_positions"], m["num_kv_heads"]) == ("gelu", "layernorm", 256, True, True, 0.1, 128, 4)
    assert out["overrides"]["step"] == {"seq": 128, "precision": "fp32"}
    assert out["overrides"]["impl"] == {"recompute": "full"}
    assert out["overrides"]["parallel"] == {"pp": 2, "schedule": "interleaved", "virtual_stages": 1}
    assert any("block" in n for n in out["notes"])


@pytest.mark.parametrize("text, needle", [
    ("--num-layers two", "--num-layers='two' must be an integer"),
    ("--micro-batch-size -1", "--micro-batch-size=-1 must be positive"),
    ("--seq-length 0", "--seq-length=0 must be positive"),
    ("--recompute-granularity partial", "must be one of full, selective"),
    ("--bf16 --fp16", "both given"),
    ("--bf16=true", "takes no value"),
    ('--data-path "unclosed', "cannot split"),
    ("--hidden-dropout 1.5", "must be in [0, 1)"),
    ("--tensor-model-parallel-size", "needs a value"),
    ("x" * 70_000, "more than"),
])
def test_megatron_errors(text, needle):
    with pytest.raises(ConfigError) as exc:
        parse_megatron_args(text)
    assert needle in str(exc.value)


# torchtitan --------------------------------------------------------------------------------------

TITAN = """
[job]
description = "Llama 3 8B training"
[model]
name = "llama3"
flavor = "8B"
[optimizer]
name = "AdamW"
lr = 3e-4
[training]
local_batch_size = 2
seq_len = 8192
mixed_precision_param = "bfloat16"
steps = 1000
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 4
tensor_parallel_degree = 2
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
"""


def test_torchtitan_exact(tmp_path):
    out = read_torchtitan(write(tmp_path, "llama3_8b.toml", TITAN))
    assert out["overrides"] == {
        "model": {"name": "llama-3-8b"},
        # with FSDP, bfloat16 is fully_shard's MixedPrecisionPolicy (tests/inputs/test_torchtitan_keys.py)
        "step": {"batch": 2, "seq": 8192, "precision": "fsdp-bf16", "optimizer": "adamw", "grad_accum": 1},
        "impl": {"recompute": "every-k", "recompute_every": 2},
        # dp = 2 replicas × 4 shards; TP in torchtitan always comes with sequence parallelism
        "parallel": {"dp": 8, "fsdp": "hybrid", "fsdp_group": 4, "tp": 2, "pp": 1, "sp": True, "schedule": "1f1b",
                     "reshard_after_forward": True, "fsdp_units": "blocks+embed+head"},
    }
    assert out["raw"]["training.seq_len"] == 8192


def test_torchtitan_variants(tmp_path):
    out = read_torchtitan(write(tmp_path, "t.toml", """
[model]
name = "deepseek_v3"
flavor = "16B"
[training]
batch_size = 1
[parallelism]
data_parallel_shard_degree = -1
[activation_checkpoint]
mode = "full"
"""))
    # keys the file leaves out take torchtitan's defaults (seq_len 2048, AdamW, bf16 param_dtype under FSDP)
    assert out["overrides"] == {"step": {"batch": 1, "seq": 2048, "optimizer": "adamw", "precision": "fsdp-bf16",
                                         "grad_accum": 1},
                                "impl": {"recompute": "full"}, "parallel": {"fsdp": "full", "reshard_after_forward": True,
                                                                            "fsdp_units": "blocks+embed+head"}}
    assert any("not a trainmem preset" in n for n in out["notes"])
    assert any("-1" in n for n in out["notes"])


@pytest.mark.parametrize("text, needle", [
    ("[activation_checkpoint]\nmode = \"memory_budget\"\n", "mode='memory_budget'"),
    ("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"x\"\n", "selective_ac_option='x'"),
    ("[training]\nseq_len = \"long\"\n", "seq_len='long' must be int"),
    ("[parallelism]\ntensor_parallel_degree = 0\n", "tensor_parallel_degree=0 must be positive"),
    ("[parallelism]\npipeline_parallel_schedule = \"Magic\"\n", "pipeline_parallel_schedule='Magic'"),
    ("training = 5\n", "[training] must be a table"),
])
def test_torchtitan_errors(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        read_torchtitan(write(tmp_path, "t.toml", text))
    assert needle in str(exc.value)
