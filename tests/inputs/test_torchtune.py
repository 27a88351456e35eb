"""Each torchtune key -> the spec field it sets, as torchtune's fine-tuning recipes run it (issue 13, item 9).

The YAML files under data/torchtune/ are torchtune's own, copied unchanged from pytorch/torchtune
bd2a0fc (recipes/configs/<family>/<name>.yaml, the folder and name joined by '_'). Citations are to
that commit.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from trainmem.cli import main
from trainmem.cliargs import add_finetune_args, add_model_step_args, add_optimizer_args, finetune_from_args
from trainmem.errors import ConfigError
from trainmem.inputs import add_input_args, apply_inputs, read_torchtune
from trainmem.specs.step import DEFAULT_SEQ

DATA = Path(__file__).parent / "data" / "torchtune"


def read(tmp_path, text: str) -> dict:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return read_torchtune(p)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_step_args(p)
    add_optimizer_args(p)
    add_finetune_args(p)
    add_input_args(p)
    args = p.parse_args(argv)
    args.inputs = apply_inputs(args, p)
    return args


def test_lora_single_device_recipe():
    a = read_torchtune(DATA / "llama3_8B_lora_single_device.yaml")
    assert a["overrides"] == {
        "model": {"name": "llama-3-8b"},  # model._component_: torchtune.models.llama3.lora_llama3_8b
        "step": {"batch": 2, "grad_accum": 8,
                 "precision": "bf16",  # dtype: bf16, the model built under set_default_dtype(bf16)
                 "optimizer": "adamw",  # torch.optim.AdamW
                 "loss": "ce"},  # LinearCrossEntropyLoss keeps each chunk's fp32 log-softmax
        "impl": {"device": "cuda", "optimizer_impl": "fused",  # AdamW(fused=True)
                 "recompute": "full"},  # enable_activation_checkpointing: every TransformerSelfAttentionLayer
        "finetune": {"mode": "lora",
                     # lora_attn_modules [q_proj, v_proj, output_proj] + apply_lora_to_mlp (w1, w2, w3)
                     "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"),
                     "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
                     "adapter_dtype": "param"},  # adapters built in the model's dtype
    }
    notes = "\n".join(a["notes"])
    assert "max_seq_len is null" in notes and f"default {DEFAULT_SEQ}" in notes
    assert "LinearCrossEntropyLoss" in notes


def test_qlora_builder_is_qlora():
    # torchtune/models/llama2/_model_builders.py: qlora_llama2_7b = partial(lora_llama2_7b, quantize_base=True)
    a = read_torchtune(DATA / "llama2_7B_qlora_single_device.yaml")
    assert a["overrides"]["model"] == {"name": "llama-2-7b"}
    assert a["overrides"]["finetune"]["mode"] == "qlora"
    assert any("to_nf4" in n for n in a["notes"])


def test_quantize_base_on_a_lora_builder(tmp_path):
    a = read(tmp_path, "model:\n  _component_: torchtune.models.llama3.lora_llama3_8b\n"
                       "  lora_attn_modules: [q_proj, k_proj]\n  quantize_base: true\n  apply_lora_to_output: true\n"
                       "dtype: bf16\n")
    ft = a["overrides"]["finetune"]
    assert ft["mode"] == "qlora" and ft["lora_targets"] == ("q_proj", "k_proj", "lm_head")
    # torchtune >= 0.3: every linear but the head is a torchao NF4Tensor (FrozenNF4Linear or LoRALinear)
    assert ft["quant_impl"] == "torchao-nf4" and ft["qlora_scope"] == "all"
    # lora_llama3_8b's defaults for the rest, said in a note
    assert (ft["lora_rank"], ft["lora_alpha"]) == (8, 16.0)
    assert any("apply_lora_to_mlp=False" in n and "lora_rank=8" in n for n in a["notes"])


def test_full_single_device_low_memory_settings():
    # llama3_1/8B_full_single_device.yaml: PagedAdamW8bit and optimizer_in_bwd
    a = read_torchtune(DATA / "llama3_1_8B_full_single_device.yaml")
    assert a["overrides"]["model"] == {"name": "llama-3-8b"}  # Llama 3.1 8B: Llama 3 8B's shapes
    assert a["overrides"]["step"]["optimizer"] == "paged-adamw8bit"  # paged states: their own figure
    # full_finetune_single_device.py, _setup_optimizer: register_optim_in_bwd_hooks
    assert a["overrides"]["impl"]["optimizer_in_backward"] is True
    assert "finetune" not in a["overrides"]
    notes = "\n".join(a["notes"])
    assert "llama-3-8b's shapes" in notes


def test_distributed_recipe_shards_with_fsdp():
    a = read_torchtune(DATA / "llama3_1_8B_full.yaml")
    # full_finetune_distributed.py: data_parallel_shard_dim defaults to -1 (every rank left)
    # custom_sharded_layers: ['tok_embeddings', 'output'] -> their own FSDP units (estimate/fsdp_units.py)
    assert a["overrides"]["parallel"] == {"fsdp": "full", "fsdp_units": "blocks+embed+head"}
    notes = "\n".join(a["notes"])
    assert "give --dp" in notes


def test_distributed_keys(tmp_path):
    a = read(tmp_path, "model:\n  _component_: torchtune.models.llama3.llama3_8b\ndtype: bf16\n"
                       "data_parallel_shard_dim: 4\ndata_parallel_replicate_dim: 2\nfsdp_reshard_after_forward: false\n"
                       "fsdp_cpu_offload: true\n")
    assert a["overrides"]["parallel"] == {"fsdp": "hybrid", "dp": 8, "fsdp_group": 4, "reshard_after_forward": False,
                                          "offload": ("optimizer", "params")}


def test_packed_dataset_sets_the_sequence(tmp_path):
    base = "model:\n  _component_: torchtune.models.llama2.llama2_7b\ndtype: fp32\ntokenizer:\n  max_seq_len: 2048\n"
    packed = read(tmp_path, base + "dataset:\n  packed: true\n")
    assert packed["overrides"]["step"]["seq"] == 2048 and packed["overrides"]["step"]["precision"] == "fp32"
    assert not any("padded" in n for n in packed["notes"])
    padded = read(tmp_path, base + "dataset:\n  packed: false\n")
    assert padded["overrides"]["step"]["seq"] == 2048
    assert any("padded to their longest sample" in n for n in padded["notes"])
    with pytest.raises(ConfigError, match="packed=True needs tokenizer.max_seq_len"):
        read(tmp_path, "model:\n  _component_: torchtune.models.llama2.llama2_7b\ndataset:\n  packed: true\n")


@pytest.mark.parametrize("text, message", [
    ("enable_activation_checkpoint: true\n", "unknown key 'enable_activation_checkpoint' (did you mean "
                                             "'enable_activation_checkpointing'?)"),
    ("teacher_model:\n  _component_: x\n", "teacher_model: knowledge distillation"),
    ("loss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n", "loss._component_='torchtune.rlhf.loss.DPOLoss'"),
    ("batch_size: 0\n", "batch_size=0 must be positive"),
    ("dtype: float8\n", "dtype='float8' must be bf16, fp32 or fp16"),
    ("ac_mode: selective\nac_option: -2\n", "ac_mode='selective' with ac_option=-2"),
])
def test_bad_keys_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read(tmp_path, "model:\n  _component_: torchtune.models.llama3.llama3_8b\n" + text)


def test_dora_and_model_keys(tmp_path):
    with pytest.raises(ConfigError, match="use_dora=True: DoRA"):
        read(tmp_path, "model:\n  _component_: torchtune.models.llama3.lora_llama3_8b\n"
                       "  lora_attn_modules: [q_proj]\n  use_dora: true\n")
    with pytest.raises(ConfigError, match="model: unknown key 'lora_ranks'"):
        read(tmp_path, "model:\n  _component_: torchtune.models.llama3.lora_llama3_8b\n  lora_ranks: 8\n")
    with pytest.raises(ConfigError, match="model.lora_rank needs a lora_ or qlora_ model builder"):
        read(tmp_path, "model:\n  _component_: torchtune.models.llama3.llama3_8b\n  lora_rank: 8\n")


def test_nothing_in_the_file_runs(tmp_path):
    # yaml.safe_load: a python tag is an error, never a call
    with pytest.raises(ConfigError, match="invalid YAML"):
        read(tmp_path, "model: !!python/object/apply:os.system ['echo hi']\n")


@pytest.mark.parametrize("body, message", [
    (b"", "expected a YAML mapping, got a NoneType"),
    (b"- a\n- b\n", "expected a YAML mapping, got a list"),
    (b"model: {_component_: x\n", "invalid YAML"),
    (b"\xff\xfe\x00", "not UTF-8 text"),
    (b"a: &x [1, 2]\nb: [*x, *x]\n", "aliases (*name) are not read"),
    (b"compile: " + b"[" * 5000 + b"]" * 5000 + b"\n", "YAML nested too deeply"),
])
def test_hostile_files(tmp_path, capsys, body, message):
    p = tmp_path / "bad.yaml"
    p.write_bytes(body)
    assert main(["estimate", "--torchtune", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_unknown_model_needs_model_on_the_command_line(tmp_path):
    p = tmp_path / "qwen.yaml"
    p.write_text("model:\n  _component_: torchtune.models.qwen2_5.qwen2_5_3b\ndtype: bf16\nbatch_size: 4\n")
    with pytest.raises(ConfigError, match="qwen2_5_3b' has no bundled preset .*give the model with --model"):
        parse(["--torchtune", str(p)])
    args = parse(["--torchtune", str(p), "--model", "qwen2.5-7b"])
    assert (args.model, args.batch, args.precision) == ("qwen2.5-7b", 4, "bf16")


def test_command_line_over_file():
    path = str(DATA / "llama3_8B_lora_single_device.yaml")
    args = parse(["--torchtune", path, "--batch", "1", "--lora-rank", "32", "--optimizer-impl", "foreach"])
    assert (args.batch, args.grad_accum, args.lora_rank, args.lora_alpha) == (1, 8, 32, 16.0)
    assert args.optimizer_impl == "foreach"
    assert {"step.batch", "finetune.lora_rank", "impl.optimizer_impl"} <= set(args.inputs["overridden_by_command_line"])
    spec = finetune_from_args(args)
    assert (spec.mode, spec.lora_rank, spec.adapter_dtype) == ("lora", 32, "param")


def test_estimate_equals_the_same_settings_as_flags(capsys):
    path = str(DATA / "llama3_8B_lora_single_device.yaml")
    assert main(["estimate", "--torchtune", path, "--seq", "1024", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--model", "llama-3-8b", "--batch", "2", "--grad-accum", "8", "--seq", "1024",
                 "--precision", "bf16", "--recompute", "full", "--optimizer-impl", "fused", "--finetune", "lora",
                 "--lora-targets", "q_proj,v_proj,o_proj,gate_proj,down_proj,up_proj", "--lora-alpha", "16",
                 "--adapter-dtype", "param", "--json"]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    assert from_file["peak_bytes"] == from_flags["peak_bytes"]
    assert from_file["inputs"]["files"]["torchtune"]["notes"]


def test_cli_prints_the_notes(capsys):
    path = str(DATA / "llama3_1_8B_full_single_device.yaml")
    assert main(["estimate", "--torchtune", path, "--summary"]) == 0
    out = capsys.readouterr().out
    assert f"from {path}:" in out
    assert "  - torchtune.models.llama3_1.llama3_1_8b has llama-3-8b's shapes" in out
    # PagedAdamW8bit runs as itself (its paged states are their own figure, no note since aaee13f)
    assert "paged-adamw8bit" in out.splitlines()[0]


def test_cli_bad_file_is_one_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  _component_: torchtune.models.llama3.llama3_8b\nbatch_sise: 2\n")
    assert main(["estimate", "--torchtune", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'batch_sise'" in err


# --- against torchtune itself (skipped where torchtune is not installed: it needs a torchao that
# matches torch; run with torchtune 0.6.1 and torchao 0.14.1 over torch 2.13 for this commit) ------

@pytest.mark.parametrize("name, trainable", [
    # r=8 on q, v, o and w1, w2, w3: per layer q 8·(4096+4096) + v 8·(4096+1024) + o 8·(4096+4096)
    # + 3 × 8·(4096+14336) = 614400; × 32 layers = 19660800
    ("llama3_8B_lora_single_device.yaml", 19_660_800),
    # Llama-2-7B (kv = 4096, FFN 11008): 3 × 65536 + 3 × 8·(4096+11008) = 559104; × 32 = 17891328
    ("llama2_7B_qlora_single_device.yaml", 17_891_328),
    ("llama3_1_8B_full.yaml", 8_030_261_248),  # Llama-3-8B's parameters: every one trains
    ("llama3_1_8B_full_single_device.yaml", 8_030_261_248),
])
def test_trainable_parameters_match_torchtune(name, trainable):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtune")
    from omegaconf import OmegaConf
    from torchtune import config, training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.specs.loaders import load_model

    cfg = OmegaConf.load(DATA / name)
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        model = config.instantiate(cfg.model)  # torchtune's own builder, on the meta device
    o = read_torchtune(DATA / name)["overrides"]
    if "finetune" in o:
        set_trainable_params(model, get_adapter_params(model))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    ft = FinetuneSpec(**o["finetune"]) if "finetune" in o else None
    e = estimate(load_model(o["model"]["name"]), StepSpec(batch=1, seq=128, precision="bf16"), ImplSpec(), finetune=ft)
    assert e.totals_bytes["gradient"] == 2 * trainable  # bf16 gradients, one per trainable parameter


def test_chunked_output_loss_keeps_every_chunk_like_plain_ce():
    # the reason CEWithChunkedOutputLoss maps to "ce": its saved set is every chunk's fp32 log-softmax
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtune")
    from torchtune.models.llama3._component_builders import llama3
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    B, S, V = 2, 64, 1000
    model = llama3(vocab_size=V, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=S)
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    ids, labels = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    logits = model(ids)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(logits, labels)
    fp32 = sum(n for n, dtype in saved.values() if dtype == torch.float32 and n > 64)
    assert fp32 == B * S * V * 4  # 8 chunks × (16 × 1000) × 4 = 512000: nothing recomputed
