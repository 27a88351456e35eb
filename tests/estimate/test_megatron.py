"""The ``megatron`` profile against Korthikanti et al. 2022 (arXiv 2205.05198), to the byte."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate.activations import activation_items
from trainmem.estimate.rules_megatron import megatron_layer_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

# (s, b, h, a, L)
SIZES = [(2048, 1, 12288, 96, 2), (512, 4, 1024, 16, 3), (128, 2, 256, 8, 1), (4096, 8, 4096, 32, 2)]


def _layer_bytes(s, b, h, a, L, recompute="none", precision="bf16"):
    model = ModelSpec(hidden_size=h, num_layers=L, num_heads=a, ffn_size=4 * h, vocab_size=1000,
                      activation="gelu", norm="layernorm")
    items = activation_items(model, StepSpec(batch=b, seq=s, precision=precision),
                             ImplSpec(profile="megatron", recompute=recompute))
    per_layer = [sum(i.bytes for i in items if i.name.startswith(f"layers.{n}.")) for n in range(L)]
    rest = {i.name: i.bytes for i in items if not i.name.startswith("layers.")}
    return per_layer, rest


@pytest.mark.parametrize("s, b, h, a, L", SIZES)
def test_no_recompute_is_sbh_34_plus_5as_over_h(s, b, h, a, L):
    per_layer, _ = _layer_bytes(s, b, h, a, L)
    expect = 34 * s * b * h + 5 * a * s * s * b  # sbh(34 + 5as/h)
    assert per_layer == [expect] * L
    assert sum(per_layer) == expect * L


def test_gpt3_175b_layer_in_numbers():
    # s=2048, b=1, h=12288, a=96: 34·2048·12288 = 855_638_016; 5·96·2048²·1 = 2_013_265_920
    per_layer, _ = _layer_bytes(2048, 1, 12288, 96, 1)
    assert per_layer == [855_638_016 + 2_013_265_920]  # 2_868_903_936 bytes ≈ 2.67 GiB


@pytest.mark.parametrize("s, b, h, a, L", SIZES)
def test_selective_recompute_is_34_sbh(s, b, h, a, L):
    per_layer, _ = _layer_bytes(s, b, h, a, L, "selective")
    assert per_layer == [34 * s * b * h] * L


@pytest.mark.parametrize("s, b, h, a, L", SIZES)
def test_full_recompute_is_2_sbh(s, b, h, a, L):
    per_layer, _ = _layer_bytes(s, b, h, a, L, "full")
    assert per_layer == [2 * s * b * h] * L


def test_small_case_by_hand():
    # s=128, b=2, h=256, a=8: sbh = 65_536; 34·65_536 = 2_228_224; 5·8·128²·2 = 1_310_720
    per_layer, _ = _layer_bytes(128, 2, 256, 8, 1)
    assert per_layer == [3_538_944]
    assert _layer_bytes(128, 2, 256, 8, 1, "selective")[0] == [2_228_224]
    assert _layer_bytes(128, 2, 256, 8, 1, "full")[0] == [131_072]  # 2·65_536


def test_outside_the_layers():
    # s=128, b=2, h=256, v=1000: dropout mask sbh = 65_536; final layernorm and output
    # projection inputs 2sbh = 131_072 each; fp32 logits 4sbv = 4·128·2·1000 = 1_024_000
    _, rest = _layer_bytes(128, 2, 256, 8, 1)
    assert rest == {"input_ids": 2_048, "embedding.dropout_mask": 65_536, "final_layernorm.input": 131_072,
                    "output_layer.input": 131_072, "loss.logits_fp32": 1_024_000}


def test_activations_are_16_bit_whatever_the_precision():
    assert _layer_bytes(128, 2, 256, 8, 1, precision="fp32")[0] == _layer_bytes(128, 2, 256, 8, 1)[0]


@pytest.mark.parametrize("start,checkpointed", [("kth", (1, 3)), ("first", (0, 2))])
def test_every_k_checkpoints_blocks_k_minus_1_or_0(start, checkpointed):
    """torchtitan's and torchtune's count (``kth``, the default) checkpoints blocks 1 and 3 at k=2, transformers'
    every_n_layers (``first``) blocks 0 and 2 (ImplSpec.checkpointed): a checkpointed block keeps its input alone."""
    model = ModelSpec(hidden_size=256, num_layers=4, num_heads=8, ffn_size=1024, vocab_size=1000)
    items = activation_items(model, StepSpec(batch=2, seq=128, precision="bf16"),
                             ImplSpec(profile="megatron", recompute="every-k", recompute_every=2, recompute_from=start))
    per_layer = [sum(i.bytes for i in items if i.name.startswith(f"layers.{n}.")) for n in range(4)]
    assert per_layer == [131_072 if n in checkpointed else 3_538_944 for n in range(4)]


# --- the closed forms of Table 2 ---------------------------------------------------------------

@pytest.mark.parametrize("s, b, h, a, L", SIZES)
def test_closed_form_matches_the_itemized_layer(s, b, h, a, L):
    for recompute in ("none", "selective", "full"):
        assert _layer_bytes(s, b, h, a, 1, recompute)[0] == [megatron_layer_bytes(s, b, h, a, recompute=recompute)]


def test_tensor_parallel_closed_forms():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h  # 25_165_824
    # sbh(10 + 24/t + 5as/(ht)) = 10·sbh + 3·sbh + 5·96·2048²/8 = 251_658_240 + 75_497_472 + 251_658_240
    assert megatron_layer_bytes(s, b, h, a, tp=t) == 578_813_952
    # sbh(34/t + 5as/(ht)) = 34·sbh/8 + 251_658_240 = 106_954_752 + 251_658_240
    assert megatron_layer_bytes(s, b, h, a, tp=t, sp=True) == 358_612_992
    assert megatron_layer_bytes(s, b, h, a, tp=t, recompute="selective") == 10 * sbh + 3 * sbh
    assert megatron_layer_bytes(s, b, h, a, tp=t, sp=True, recompute="selective") == 106_954_752
    assert megatron_layer_bytes(s, b, h, a, tp=t, recompute="full") == 2 * sbh
    # with SP the layer input kept for recompute is itself split: 2·sbh/t
    assert megatron_layer_bytes(s, b, h, a, tp=t, sp=True, recompute="full") == 2 * sbh // t
    # t = 1: every variant is the unsharded formula
    assert megatron_layer_bytes(s, b, h, a, tp=1, sp=True) == megatron_layer_bytes(s, b, h, a)


@pytest.mark.parametrize("kw", [dict(tp=5), dict(tp=0), dict(recompute="every-k")])
def test_closed_form_rejects_bad_input(kw):
    with pytest.raises(SpecError):
        megatron_layer_bytes(2048, 1, 12288, 96, **kw)
