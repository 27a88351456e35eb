"""TRL's ModelConfig keys in --hf-args (inputs/trl_model.py): LoRA, the 4-bit base, the weights' dtype."""

from __future__ import annotations

import pytest

from trainmem.errors import ConfigError
from trainmem.inputs.hf_args import hf_args_overrides


def _read(**cfg) -> dict:
    return hf_args_overrides(cfg, "trl.json")


def test_qlora_from_model_config():
    a = _read(use_peft=True, lora_r=32, lora_target_modules=["all-linear"], load_in_4bit=True, dtype="bfloat16",
              attn_implementation="flash_attention_2", bf16=True)
    ft = a["overrides"]["finetune"]
    # trl/trainer/utils.py get_quantization_config: bnb_4bit_use_double_quant=use_bnb_nested_quant (default False),
    # bnb_4bit_compute_dtype=dtype; ModelConfig's lora_alpha 32, lora_dropout 0.05
    assert ft == {"mode": "qlora", "lora_rank": 32, "lora_alpha": 32.0, "lora_dropout": 0.05,
                  "lora_targets": ("all-linear",), "quant_type": "nf4", "double_quant": False,
                  "compute_dtype": "bfloat16"}
    assert a["overrides"]["step"]["precision"] == "bf16" and a["overrides"]["impl"]["attention"] == "flash"


def test_lora_defaults_and_no_peft():
    ft = _read(use_peft=True)["overrides"]["finetune"]
    assert ft == {"mode": "lora", "lora_rank": 16, "lora_alpha": 32.0, "lora_dropout": 0.05}
    assert "finetune" not in _read(lora_r=8)["overrides"]  # without use_peft TRL builds no adapters


@pytest.mark.parametrize("cfg,word", [
    (dict(load_in_4bit=True), "use_peft"),
    (dict(use_peft=True, load_in_8bit=True), "load_in_8bit"),
    (dict(use_peft=True, use_dora=True), "use_dora"),
    (dict(use_peft=True, lora_modules_to_save=["score"]), "lora_modules_to_save"),
    (dict(attn_implementation="flex"), "attn_implementation"),
])
def test_refused_in_one_line(cfg, word):
    with pytest.raises(ConfigError, match=word):
        _read(**cfg)


def test_cli_reads_trl_keys(tmp_path):
    import json
    import subprocess
    import sys

    path = tmp_path / "trl.json"
    path.write_text(json.dumps({"use_peft": True, "load_in_4bit": True, "use_bnb_nested_quant": True,
                                "lora_target_modules": ["q_proj", "v_proj"], "dtype": "bfloat16"}))
    out = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "--model", "llama-3-8b", "--hf-args", str(path),
                          "--seq", "1024", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ft = json.loads(out.stdout)["inputs"]["finetune"]
    assert (ft["mode"], ft["double_quant"], ft["compute_dtype"], ft["lora_targets"]) == (
        "qlora", True, "bfloat16", ["q_proj", "v_proj"])
