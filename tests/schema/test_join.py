"""estimate and trace join item by item on tiny models (hidden 64, 2 layers, S=32).

Model states join per tensor by name (``model.layers.0.mlp.up_proj.weight.exp_avg``). Activations
join per tensor by key (``trainmem.join``): ``<module path>:<bytes>B:<k>``, the k-th tensor of that
size the module made (creation order) among those backward keeps. The estimator labels a saved tensor by its role
(``q_rope``, ``sdpa_out``) and the trace by the aten op that made it (``cat``, ``cat:1``); the keys
are the same on both sides. Trace item names are unique (``:k`` marks the k-th repeat).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from schema_runs import TINY_LLAMA
from trainmem.join import join_items, module_of as _module

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
    assert set(tr) == set(est)  # the rotary buffers are not parameters: the trace files them as buffers
    buffers = {i["name"]: (i["dtype"], i["bytes"], i["note"]) for i in t["items"] if i["category"] == "buffer"}
    # LlamaRotaryEmbedding.__init__ (transformers/models/llama/modeling_llama.py): inv_freq and its
    # clone original_inv_freq, nn.Buffer(persistent=False), hd/2 = 8 fp32 each; the estimate's buffer
    # ledger (estimate/buffers.py) has the same two, name for name
    assert buffers == {"model.rotary_emb.inv_freq": ("float32", 32, "buffer"),
                       "model.rotary_emb.original_inv_freq": ("float32", 32, "buffer")}
    assert {i["name"]: (i["dtype"], i["bytes"], "buffer") for i in e["items"] if i["category"] == "buffer"} == buffers
    # totals at the peak count allocator blocks (512-B rounded): 2 × 512; the estimate's are logical bytes
    assert t["totals_at_peak_bytes"]["buffer"] == 2 * 512 and e["totals_bytes"]["buffer"] == 2 * 32
    params = [i["bytes"] for i in e["items"] if i["category"] == "parameter"]
    assert t["totals_at_peak_bytes"]["parameter"] == sum(-(-b // 512) * 512 for b in params)


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
    # trace, not an op output (256 B); the trace's loss has one more fp32 scalar (4 B: backward's seed,
    # the loss itself is the estimate's loss.value); both keep the labels padded to S+1 (1·33·8 = 264 B at B=1)
    assert est["model.embed_tokens"] == Counter({("int64", 256): 1}) and "model.embed_tokens" not in tr
    root_e, root_t = sum(b * n for (_, b), n in est["(root)"].items()), sum(b * n for (_, b), n in tr["(root)"].items())
    assert root_t - root_e == 4


# tests/trace/tiny_models.py's shapes; vocabulary 1000
TINY = {
    "llama": TINY_LLAMA,
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
                 attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                    num_local_experts=4, num_experts_per_tok=2),
}
CASES = [(f, p, a) for f in TINY for p in ("fp32", "bf16") for a in ("eager", "sdpa") if f != "mixtral" or p == "bf16"]


def _unequal(family: str, precision: str, attention: str) -> dict:
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config
    from trainmem.trace import trace_step

    cfg = TINY[family]
    step, impl = StepSpec(batch=1, seq=32, precision=precision), ImplSpec(device="cpu", attention=attention)
    # Mixtral routes real tokens (which experts get how many is data-dependent), as in tests/test_compare.py
    rows = join_items(estimate(spec_from_hf_config(cfg, name="tiny"), step, impl).inventory,
                      trace_step(cfg, step, impl, real=family == "mixtral").items)
    assert sum(r.equal for r in rows) > 20
    return {r.key: (r.estimate and (r.estimate.dtype, r.estimate.bytes), r.trace and (r.trace.dtype, r.trace.bytes))
            for r in rows if not r.equal}


@pytest.mark.parametrize("family,precision,attention", CASES)
def test_activations_join_per_tensor_by_key(family, precision, attention):
    """Every activation key has one partner on the other side with the same dtype and bytes, except
    the stated differences below, each named with its bytes."""
    diff = _unequal(family, precision, attention)
    # The size in the key makes the join independent of the order in which a module makes tensors of
    # different sizes: eager attention, where the estimator makes v's repeat_kv after the softmax
    # (transformers' eager_attention_forward repeats k and v first), and Mixtral's grouped-mm
    # experts, whose routing indices the estimator makes in another order than transformers'
    # grouped_mm path, pair tensor by tensor with no exception
    B, S = 1, 32
    # the token ids the embedding keeps are an input to the trace, not an op output (B·S·8 = 256 B);
    # the trace has one more fp32 scalar in the loss (backward's seed, ones_like; the loss itself and
    # nll_loss's total weight pair: loss.value :0, total_weight :1). The padded labels (B·(S+1)·8 = 264 B
    # at B=1) pair on both sides
    expected = {
        f"(inputs):{B * S * 8}B:0": (("int64", B * S * 8), None),
        "(root):4B:2": (None, ("float32", 4)),
    }
    # GPT2Model.forward makes the position ids in `transformer`, and the estimator names them there
    # (`transformer:256B:0` pairs). GPT-2's eager attention at B = 1 keeps all of c_attn's output (q is a
    # view of its B·S·3H storage, and the reshape for bmm stays a view): the estimator keeps it too since
    # 27511ee (attention_core ``fused``), so those keys pair as well (before: 2·B·S·H·itemsize low per layer)
    assert diff == expected
