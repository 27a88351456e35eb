"""Every registered family declares what the estimator asks of it (issue 16 part 2), and the
default LoRA targets are peft's own: real ``get_peft_model`` without ``target_modules`` adapts
exactly the modules ``--finetune lora`` adapts by default."""

from __future__ import annotations

import pytest

from trainmem import families as F
from trainmem.estimate.finetune import adapter_parameters
from trainmem.estimate.heads import head_layout
from trainmem.specs import ModelSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config


@pytest.mark.parametrize("fam", F.families(), ids=lambda f: f.name)
def test_every_family_declares_heads_tp_roles_lora_targets_and_names(fam):
    assert fam.embeddings and fam.head and fam.layers and fam.output_layer
    assert fam.output_layer.partition(".")[0] in {h.partition(".")[0] for h in fam.head}
    heads = fam.task_heads
    assert heads.seq_module and heads.tok_module
    assert fam.tp.column and fam.tp.row and fam.tp.vocab
    assert set(fam.tp.kv) <= set(fam.tp.column) and set(fam.tp.packed) <= set(fam.tp.column)
    assert fam.lora_targets and all(isinstance(t, str) and t for t in fam.lora_targets)
    assert isinstance(fam.peft_default, bool) and isinstance(fam.compiled_rules, bool)


@pytest.mark.parametrize("fam", [f for f in F.families() if f.config is not None], ids=lambda f: f.name)
def test_the_default_lora_targets_adapt_a_layer_of_every_family(fam):
    """On the config class's defaults, the default targets match at least one linear."""
    m = spec_from_hf_config({"model_type": fam.name, **fam.config.defaults}, name=fam.name)
    adapters = adapter_parameters(m, FinetuneSpec(mode="lora"))
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n, _, _ in adapters)


def test_the_task_heads_come_from_the_registry():
    gpt2 = ModelSpec(family="gpt2", hidden_size=64, num_layers=1, num_heads=4, ffn_size=128, vocab_size=100,
                     norm="layernorm", activation="gelu", head="token-cls")
    assert head_layout(gpt2) is F.get_family("gpt2").task_heads
    enc = ModelSpec(family="generic", arch="encoder", hidden_size=64, num_layers=1, num_heads=4, ffn_size=128,
                    vocab_size=100, norm="layernorm", activation="gelu", head="seq-cls")
    assert head_layout(enc) is F.get_family("bert").task_heads  # a generic encoder takes BERT's heads
    assert F.task_head_modules() == ("score", "classifier")


def test_an_explicit_target_list_is_kept_and_none_takes_the_family_default():
    gpt2 = ModelSpec(family="gpt2", hidden_size=64, num_layers=1, num_heads=4, ffn_size=128, vocab_size=100,
                     norm="layernorm", activation="gelu")
    assert FinetuneSpec(mode="lora").for_model(gpt2).lora_targets == ("c_attn",)
    assert FinetuneSpec(mode="lora", lora_targets=("c_fc",)).for_model(gpt2).lora_targets == ("c_fc",)
    assert FinetuneSpec(mode="lora").for_model(None).lora_targets is None


# real peft on tiny configs ------------------------------------------------------------------------

_TINY = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64),
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     vocab_size=128),
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  vocab_size=128),
    "bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128),
    "phi3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128,
                 pad_token_id=0),
    "olmo2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  vocab_size=128, pad_token_id=0),
}


def _peft_adapters(model_type: str, targets):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **_TINY[model_type])
    auto = transformers.AutoModelForMaskedLM if model_type == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg)
    conv1d = model_type == "gpt2"
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, target_modules=targets,
                                                         fan_in_fan_out=conv1d))
    prefix = "base_model.model."
    return sorted((n[len(prefix):], tuple(p.shape)) for n, p in wrapped.named_parameters() if ".lora_" in n)


def _ours(model_type: str) -> list:
    m = spec_from_hf_config({"model_type": model_type, **_TINY[model_type]}, name=model_type)
    return sorted((n, s) for n, s, _ in adapter_parameters(m, FinetuneSpec(mode="lora")))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama", "bert"])
def test_default_targets_are_pefts_own(model_type):
    """peft's get_peft_model without target_modules adapts the same modules, with the same shapes."""
    assert F.get_family(model_type).peft_default
    assert _peft_adapters(model_type, None) == _ours(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["phi3", "olmo2"])
def test_families_peft_has_no_default_for(model_type):
    """peft refuses these model types without target_modules; with the family's targets it adapts
    what the estimator adapts."""
    fam = F.get_family(model_type)
    assert not fam.peft_default
    with pytest.raises(ValueError, match="target_modules"):
        _peft_adapters(model_type, None)
    assert _peft_adapters(model_type, list(fam.lora_targets)) == _ours(model_type)


def test_a_bad_window_is_refused_naming_the_config_key():
    from trainmem.errors import SpecError
    cfg = dict(model_type="mistral", vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(SpecError, match="sliding_window=0: must be positive"):
        spec_from_hf_config({**cfg, "sliding_window": 0})
    with pytest.raises(SpecError, match="sliding_window='16': must be an integer"):
        spec_from_hf_config({**cfg, "sliding_window": "16"})
    assert spec_from_hf_config({**cfg, "sliding_window": 16}).kinds[0].window == 16
