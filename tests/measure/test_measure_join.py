"""A measured step's activations join the estimate's tensor by tensor (tiny models, CPU, B=1, S=32).

``trainmem profile`` records the first micro-batch's forward (``trainmem.measure.tensors``: a
dispatch mode numbers the storages ops make, ``saved_tensors_hooks`` mark what autograd packs,
metadata only) and keys each activation ``<module>:<bytes>B:<k>`` as the estimator and the tracer
do (``trainmem.join``). Here the estimate's keys and the measured keys are compared one by one:
every key both sides hold has the same dtype and bytes, and the keys only one side holds are
named below with their bytes (exact ==).
"""

from __future__ import annotations

import pytest

from measure_tiny import GPT2, LLAMA

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a real step per case (3-6 s on 2 shared cores); the default set checks
# the join on test_measure_profile.py's profile (test_profile_matches_estimator_on_cpu)

B, S = 1, 32
CONFIGS = {"llama": LLAMA, "gpt2": GPT2}


def _measure(family: str, precision: str, attention: str = "sdpa", grad_accum: int = 1, **kwargs):
    from trainmem.measure.profiling import profile_model
    from trainmem.specs import ImplSpec, StepSpec

    step = StepSpec(batch=B, seq=S, precision=precision, grad_accum=grad_accum)
    impl = ImplSpec(device="cpu", attention=attention)
    return profile_model(CONFIGS[family], step, impl, device="cpu", steps=1, warmup=1, modules=False, **kwargs)


def _estimate(family: str, precision: str, attention: str = "sdpa", grad_accum: int = 1):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config

    step = StepSpec(batch=B, seq=S, precision=precision, grad_accum=grad_accum)
    impl = ImplSpec(device="cpu", attention=attention)
    return estimate(spec_from_hf_config(CONFIGS[family], name="tiny"), step, impl)


def _differences(rows) -> dict:
    """Key -> (each side's (dtype, bytes) or None) for the keys whose sides differ."""
    return {r.key: tuple(i and (i.dtype, i.bytes) for i in r.items.values()) for r in rows if not r.equal}


def _expected(family: str) -> dict:
    # none: nll_loss_forward's first output, the loss itself (an fp32 scalar the caller holds, alive at
    # the end of the forward, not saved for backward), is the estimate's loss.value, `(root):4B:0`, and
    # its total_weight (the second output, saved) `:1`, as measured. GPT-2's position ids pair (both in
    # `transformer`)
    return {}


@pytest.fixture(scope="module")
def llama_fp32():
    return _measure("llama", "fp32")


@pytest.mark.parametrize("family,precision", [(f, p) for f in CONFIGS for p in ("fp32", "bf16")])
def test_measured_activations_join_the_estimate_per_tensor(family, precision, llama_fp32):
    from trainmem.join import join_sides

    measured = llama_fp32 if (family, precision) == ("llama", "fp32") else _measure(family, precision)
    rows = join_sides({"estimate": _estimate(family, precision).inventory, "measured": measured.items})
    assert _differences(rows) == _expected(family)
    # every other key: one tensor on each side, the same dtype and bytes
    assert sum(r.equal for r in rows) == len(rows) - len(_expected(family)) > 30
    dt = "float32" if precision == "fp32" else "bfloat16"
    # the token ids the embedding keeps: made by the caller, saved for backward, keyed (inputs)
    ids = next(i for i in measured.items if i.key == f"(inputs):{B * S * 8}B:0")
    assert (ids.name, ids.dtype, ids.note) == ("(inputs).input_ids", "int64", "input saved for backward")
    assert any(i.dtype == dt for i in measured.items)


def test_a_micro_batch_keys_the_ids_it_saves():
    """With 2 micro-batches the first one's ids are a view of the whole (2B, S) batch: the item is the
    tensor the embedding saved (B·S·8), as the estimate keys it, not the caller's whole storage."""
    from trainmem.join import join_sides

    measured = _measure("llama", "fp32", grad_accum=2)
    rows = join_sides({"estimate": _estimate("llama", "fp32", grad_accum=2).inventory, "measured": measured.items})
    assert _differences(rows) == _expected("llama")
    assert next(i.shape for i in measured.items if i.key.startswith("(inputs)")) == (B, S)


def test_items_add_up_to_the_activation_ledger(llama_fp32):
    """The items are the storages made by the forward and alive at its end (plus the caller's ids):
    the same bytes the activation ledger counts as allocated after the forward minus before."""
    made = [i for i in llama_fp32.items if not i.key.startswith("(inputs)")]
    assert sum(i.bytes for i in made) == llama_fp32.totals_bytes["activation"]
    names = [i.name for i in llama_fp32.items]
    assert len(set(names)) == len(names)  # unique, as the trace's: `:k` from the second repeat on
    # SDPA's output and logsumexp, both kept (the op's two outputs, `:1` the second, as the trace names them)
    assert {"model.layers.0.self_attn._scaled_dot_product_flash_attention_for_cpu",
            "model.layers.0.self_attn._scaled_dot_product_flash_attention_for_cpu:1"} <= set(names)


def test_items_survive_the_json_and_the_gather(llama_fp32):
    import json

    from trainmem.measure.profile_result import RankProfile

    rank = llama_fp32.ranks[0]
    assert RankProfile.from_dict(json.loads(json.dumps(rank.to_dict()))) == rank  # all_gather_object's path
    d = llama_fp32.to_dict()
    assert [i["key"] for i in d["items"]] == [i.key for i in rank.items]


def test_recording_leaves_the_measured_peak_alone(llama_fp32):
    """The recorder holds metadata only: the CPU live-set peak and the ledgers are byte for byte those
    of a step measured without it."""
    bare = _measure("llama", "fp32", tensors=False)
    assert bare.items == ()
    assert (bare.peak_bytes, bare.totals_bytes) == (llama_fp32.peak_bytes, llama_fp32.totals_bytes)


def test_compare_joins_estimate_trace_and_measurement_per_tensor(llama_fp32):
    from trainmem.measure.compare import compare_run
    from trainmem.specs import ImplSpec, StepSpec

    table, _ = compare_run(LLAMA, StepSpec(batch=B, seq=S, precision="fp32"), ImplSpec(device="cpu"),
                           measured=llama_fp32)
    assert list(table.tensors[0].items) == ["estimate", "trace", "measured"]
    f4, ids = ("float32", 4), ("int64", B * S * 8)
    assert _differences(table.tensors) == {
        f"(inputs):{B * S * 8}B:0": (ids, None, ids),  # the trace sees the ids as an input, not an op output
        "(root):4B:2": (None, f4, None),                # backward's seed (ones_like), made after the forward
    }
    assert sum(r.equal for r in table.tensors) > 30
    assert table.to_dict()["tensors"][0].keys() == {"key", "estimate", "trace", "measured", "equal"}


@pytest.mark.parametrize("case", ["reference-rope", "reference-learned", "torchtune-b1", "torchtune-b2"])
def test_reference_model_and_torchtune_loss_join_per_tensor(case):
    """``--profile reference``: the position ids and rotary cos/sin are the root's (Reference.forward
    makes them), SwiGLU's activation and product mlp's (MLP.forward), the padded labels kept at B=1.
    ``--loss torchtune-chunked-ce``: one log-softmax, total weight and (from B=2) label copy per
    chunk, and from B=2 one head-input copy per chunk (lm_head's reshape), as the real step makes them."""
    from measure_tiny import reference_spec
    from trainmem.estimate import estimate
    from trainmem.join import join_sides
    from trainmem.measure.profiling import profile_model
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config

    f4 = ("float32", 4)
    if case.startswith("reference"):
        spec = reference_spec(num_layers=1, **({"max_positions": 64} if case.endswith("learned") else {}))
        cfg, step, impl = spec, StepSpec(batch=1, seq=S), ImplSpec(device="cpu", profile="reference")
        expected = {}  # the loss itself is the estimate's loss.value (see _expected)
    else:
        b = 1 if case.endswith("b1") else 2
        spec, cfg = spec_from_hf_config(LLAMA, name="tiny"), LLAMA
        step = StepSpec(batch=b, seq=S, precision="bf16", loss="torchtune-chunked-ce")
        impl = ImplSpec(device="cpu")
        expected = {}  # the loss (total / count), (root):4B:8, after the 8 chunks' total weights: loss.value
    measured = profile_model(cfg, step, impl, device="cpu", steps=1, warmup=1, modules=False)
    rows = join_sides({"estimate": estimate(spec, step, impl).inventory, "measured": measured.items})
    assert _differences(rows) == expected
    assert sum(r.equal for r in rows) == len(rows) > 20
    if case == "torchtune-b2":  # the per-chunk items: 8 log-softmax, 8 label copies, 8 head-input copies
        keys = {r.key for r in rows if r.equal}
        rows_c = 2 * S // 8
        assert {f"(root):{rows_c * 1000 * 4}B:{c}" for c in range(8)} <= keys
        assert {f"(root):{rows_c * 8}B:{c}" for c in range(8)} <= keys
        assert {f"lm_head:{rows_c * 64 * 2}B:{c}" for c in range(8)} <= keys
