"""torchtune's activation-checkpointing keys as its recipes read them (pytorch/torchtune bd2a0fc).

``recipes/full_finetune_distributed.py`` ``_setup_model`` applies ``ac_mode``/``ac_option`` only when
``enable_activation_checkpointing`` is False, and full checkpointing only when ``ac_mode`` is unset;
``torchtune/training/activations.py`` ``checkpoint_wrapper`` reads ``int(ac_option)`` (0: every
layer), so ``ac_option: op`` fails there.
"""

from __future__ import annotations

import re

import pytest

from trainmem.errors import ConfigError
from trainmem.inputs import read_torchtune

HEAD = "model:\n  _component_: torchtune.models.llama3.llama3_8b\n"


def impl_of(tmp_path, text: str) -> tuple[dict, list[str]]:
    p = tmp_path / "recipe.yaml"
    p.write_text(HEAD + text)
    a = read_torchtune(p)
    return a["overrides"].get("impl", {}), a["notes"]


@pytest.mark.parametrize("text, recompute, every", [
    ("enable_activation_checkpointing: true\n", "full", None),
    ("ac_mode: full\n", "full", None),
    ("ac_mode: selective\nac_option: 3\n", "every-k", 3),
    ("ac_mode: selective\nac_option: '3'\n", "every-k", 3),  # int("3")
    ("ac_mode: selective\nac_option: 0\n", "full", None),  # `not every_x_layer`: every layer
    ("ac_mode: selective\nac_option: 1\n", "full", None),
    ("ac_mode: none\n", "none", None),  # apply_selective_activation_checkpointing wraps nothing
])
def test_ac_keys_as_torchtune_reads_them(tmp_path, text, recompute, every):
    impl, _ = impl_of(tmp_path, text)
    assert impl.get("recompute") == recompute
    assert impl.get("recompute_every") == every


def test_both_ac_switches_checkpoint_nothing(tmp_path):
    impl, notes = impl_of(tmp_path, "enable_activation_checkpointing: true\nac_mode: selective\nac_option: 2\n")
    assert impl.get("recompute") == "none" and "recompute_every" not in impl
    assert any("applies neither" in n and "no activation checkpointing" in n for n in notes)


@pytest.mark.parametrize("text, message", [
    ("ac_mode: selective\nac_option: op\n", "ac_mode='selective' with ac_option='op'"),
    ("ac_mode: selective\n", "ac_mode='selective' with ac_option=None"),
    ("ac_mode: selective\nac_option: -2\n", "ac_mode='selective' with ac_option=-2"),
    ("ac_mode: bogus\nac_option: 2\n", "ac_mode='bogus' with ac_option=2"),
    ("ac_mode: selective\nac_option: true\n", "ac_option=True must be int or str"),
    # full_finetune_single_device.py __init__: "Gradient accumulation is not supported with optimizer_in_bwd"
    ("optimizer_in_bwd: true\ngradient_accumulation_steps: 4\n", "gradient_accumulation_steps=4, clip_grad_norm=None"),
    # ... and "Gradient clipping is not supported with optimizer_in_bwd"
    ("optimizer_in_bwd: true\nclip_grad_norm: 1.0\n", "gradient_accumulation_steps=1, clip_grad_norm=1.0"),
    # "enable_activation_offloading should only be True when enable_activation_checkpointing is True"
    ("enable_activation_offloading: true\n", "enable_activation_offloading=True needs enable_activation_checkpointing"),
])
def test_what_torchtune_refuses_is_a_one_line_error(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        impl_of(tmp_path, text)
    assert "\n" not in str(err.value)


# optimizer_in_bwd and activation offloading: the recipes' own checks (bd2a0fc) ----------------------

def test_optimizer_in_bwd_without_an_optimizer_section(tmp_path):
    """It was read after optimizer._component_'s early returns, and dropped without one."""
    impl, _ = impl_of(tmp_path, "optimizer_in_bwd: true\n")
    assert impl.get("optimizer_in_backward") is True


def test_optimizer_in_bwd_is_not_read_by_the_lora_recipes(tmp_path):
    p = tmp_path / "recipe.yaml"
    p.write_text("model:\n  _component_: torchtune.models.llama3.lora_llama3_8b\n"
                 "  lora_attn_modules: [q_proj, v_proj]\noptimizer_in_bwd: true\n")
    a = read_torchtune(p)
    assert "optimizer_in_backward" not in a["overrides"].get("impl", {})
    assert any(n.startswith("optimizer_in_bwd: torchtune's LoRA recipes do not read it") for n in a["notes"])
