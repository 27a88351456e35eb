"""The estimate names what it keeps where the real step makes it (issue 16), so its join keys
(``<module>:<bytes>B:<k>``, trainmem/join.py) are the measured step's. Estimate only, fast; the
joins against real steps are tests/measure/test_measure_join.py and tests/schema/test_join.py (slow).
"""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

B, S = 1, 32
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=1000, n_positions=256)


def _keys(model, step, impl) -> dict[str, tuple[str, str, int]]:
    return {i.key: (i.name, i.dtype, i.bytes) for i in estimate(model, step, impl).inventory.base
            if i.category.value == "activation"}


def test_gpt2_position_ids_are_made_in_transformer():
    # GPT2Model.forward makes them (arange + past length), transformer.wpe keeps them
    keys = _keys(spec_from_hf_config(GPT2), StepSpec(batch=B, seq=S), ImplSpec(device="cpu"))
    assert keys[f"transformer:{S * 8}B:0"] == ("transformer.indices", "int64", S * 8)
    assert not any(k.startswith("transformer.wpe:") for k in keys)


def test_reference_model_names_its_tables_and_products_where_it_makes_them():
    model = ModelSpec(hidden_size=64, num_layers=1, num_heads=4, ffn_size=96, vocab_size=500)
    keys = _keys(model, StepSpec(batch=B, seq=S, precision="fp32"), ImplSpec(profile="reference", device="cpu"))
    table = S * 16 * 4  # (S, hd) fp32
    # Reference.forward makes cos and sin; MLP.forward runs silu and the product (no `act` module)
    assert keys[f"(root):{table}B:0"] == ("cos", "float32", table)
    assert keys[f"(root):{table}B:1"] == ("sin", "float32", table)
    assert [keys[f"layers.0.mlp:{S * 96 * 4}B:{k}"][0] for k in (0, 1)] == ["layers.0.mlp.act", "layers.0.mlp.mul_up"]
    # at B=1 the target is a view of the labels padded to S+1
    assert keys[f"(root):{(S + 1) * 8}B:0"] == ("loss.target", "int64", (S + 1) * 8)


def test_torchtune_loss_items_are_per_chunk_with_the_same_total():
    model = spec_from_hf_config(LLAMA)
    for b in (1, 2):
        step = StepSpec(batch=b, seq=S, precision="bf16", loss="torchtune-chunked-ce")
        keys = _keys(model, step, ImplSpec(device="cpu"))
        rows = b * S // 8
        lsm = [keys[f"(root):{rows * 1000 * 4}B:{c}"] for c in range(8)]
        assert [n for n, _, _ in lsm] == [f"loss.log_softmax_chunk{c}" for c in range(8)]
        assert [keys[f"(root):4B:{c}"][0] for c in range(8)] == [f"loss.total_weight_chunk{c}" for c in range(8)]
        # the labels: one (B, S) storage at B=1 (every chunk's target a view), a copy per chunk from B=2
        labels = [keys[f"(root):{b * S * 8}B:0"]] if b == 1 else [keys[f"(root):{rows * 8}B:{c}"] for c in range(8)]
        assert sum(x[2] for x in labels) == b * S * 8
        # the head's input: h once at B=1; from B=2 one copy per chunk (lm_head's reshape), h not kept
        head = [keys.get(f"lm_head:{rows * 64 * 2}B:{c}") for c in range(8)]
        assert (head == [None] * 8) == (b == 1) and (f"model.norm:{b * S * 64 * 2}B:1" in keys) == (b == 1)
