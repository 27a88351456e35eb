"""estimate and trace join by item name on a tiny Llama (hidden 64, 2 layers, S=32, bf16, sdpa).

Model states join per tensor: the same name (``model.layers.0.mlp.up_proj.weight.exp_avg``) holds
the same bytes on both sides. Activations join per module (the name up to the last dot): the
estimator labels a saved tensor by its role (``q_rope``, ``sdpa_out``) and the trace by the aten op
that made it (``cat``, ``cat:1``), so within a module they pair by dtype and size, and every block
module pairs exactly. Trace item names are unique (``:k`` marks the k-th repeat).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from schema_runs import TINY_LLAMA
from trainmem.compare import _module

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a fake-tensor trace (a few seconds)


@pytest.fixture(scope="module")
def both():
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=1, seq=32, precision="bf16"), ImplSpec(device="cpu")
    e = estimate(spec_from_hf_config(TINY_LLAMA, name="tiny"), step, impl).to_dict()
    t = trace_step(TINY_LLAMA, step, impl).to_dict()
    return e, t


def test_trace_item_names_are_unique(both):
    _, t = both
    names = [i["name"] for i in t["items"]]
    assert len(names) == len(set(names))
    # the k and v caches are the 3rd and 4th outputs of cat in the block (the first two are freed in forward)
    assert {"model.layers.0.self_attn.cat:2", "model.layers.0.self_attn.cat:3"} <= set(names)


def test_model_states_join_per_tensor(both):
    e, t = both
    states = ("parameter", "gradient", "master_weight", "optimizer_state")
    est = {i["name"]: i for i in e["items"] if i["category"] in states}
    tr = {i["name"]: i for i in t["items"] if i["category"] in states}
    assert len(est) == 84  # 9 weights per block × 2 + embed, norm, lm_head = 21 tensors × (param, grad, m, v)
    for name, item in est.items():
        # bytes and category; a trace keeps the shape its storage was made with (model.norm.weight.grad
        # comes out of a reduction as 1×1×64), the estimate the parameter's
        assert (tr[name]["category"], tr[name]["bytes"]) == (item["category"], item["bytes"]), name
    # the trace also sees the rotary buffers (fp32, no gradient), which the estimator leaves out
    assert sorted(set(tr) - set(est)) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


def test_activations_join_per_module_and_pair_by_size(both):
    e, t = both

    def per_module(items, *, estimate):
        out = defaultdict(Counter)
        for i in items:
            if i["category"] == "activation":
                out[_module(i["name"], estimate=estimate)][(i["dtype"], i["bytes"])] += 1
        return out

    est, tr = per_module(e["items"], estimate=True), per_module(t["items"], estimate=False)
    blocks = [m for m in est if m.startswith(("model.layers.", "model.norm", "model.rotary_emb"))]
    assert len(blocks) == 16  # 2 norms, attention, mlp, gate/up projections, act_fn: 7 per layer; norm; rotary
    for m in blocks:
        assert est[m] == tr[m], m
    # where they differ, and by how much: the input ids the embedding saves are an input to the
    # trace, not an op output (256 B); the loss saves labels shifted and padded to S+1 (1·33·8 = 264 B,
    # the estimate 32·8 = 256 B) and two more fp32 scalars (4 B each)
    assert est["model.embed_tokens"] == Counter({("int64", 256): 1}) and "model.embed_tokens" not in tr
    root_e, root_t = sum(b * n for (_, b), n in est["(root)"].items()), sum(b * n for (_, b), n in tr["(root)"].items())
    assert root_t - root_e == (264 - 256) + 2 * 4
