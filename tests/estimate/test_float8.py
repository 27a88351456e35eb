"""``float8``: Float8 training as torchao's ``convert_to_float8_training`` does it (torchao 0.18).

Checked against the real mechanism: torchao's own conversion and ``Float8Linear`` on real CPU
tensors (torch 2.13 runs ``_scaled_mm`` on the CPU for both recipes), transformers models built
from config. What the forward keeps equals the estimate to the byte; under autocast the real run
sets CUDA's autocast state as well, which is what ``Float8Linear.forward`` reads on a GPU.
Importing torchao costs several CPU seconds, so every test that runs it is marked slow.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import ConfigError, SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.float8 import converted, fp8_cast_bytes, gathered_bytes_per_element
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.float8 import convert_float8, cuda_autocast_state
from trainmem.trace.live import LiveStorages
from trainmem.trace.recompute import op_sac_context
from trainmem.trace.storages import storage_key

B, S = 2, 64
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)
FAMILIES = {
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),  # q/k/v with bias: the bias is added after the fp8 mm
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128),  # Conv1D
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **SMALL),  # router
}


def _kept_by_forward(cfg: dict, recipe: str, precision: str, attention: str, op_sac: bool = False) -> int:
    """Bytes the forward leaves alive (the loss included, the ids counted once), as in
    tests/estimate/test_op_recompute.py, with torchao's conversion applied (and ``op_sac``:
    every block under torchtitan's op-level policy)."""
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = build_hf_model(cfg, attention=attention, dtype=torch.bfloat16 if precision == "bf16" else None)
    if op_sac:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": op_sac_context})
    convert_float8(model, ImplSpec(float8=recipe))
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    amp = precision == "amp-bf16"
    with LiveStorages(skip_keys=skip) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), \
                (cuda_autocast_state(torch.bfloat16) if amp else contextlib.nullcontext()):
            loss = model(ids, labels=ids).loss
    assert loss.untyped_storage().nbytes() == 4  # the fp32 loss the caller holds: the estimate's loss.value
    return live.now + ids.untyped_storage().nbytes()


def _estimated(cfg: dict, precision: str, attention: str, recipe: str, recompute: str = "none") -> int:
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention=attention, device="cpu", float8=recipe, recompute=recompute))
    return sum(i.bytes for i in items)


def test_filter_is_torchtitans_with_the_head_left_out():
    llama, gpt2, mixtral = (spec_from_hf_config(FAMILIES[f]) for f in ("llama", "gpt2", "mixtral"))
    assert converted(llama, "model.layers.0.mlp.up_proj.weight", (176, 64))  # 176 = 11·16
    assert not converted(llama, "model.layers.0.mlp.up_proj.weight", (172, 64))
    assert not converted(llama, "lm_head.weight", (512, 64))
    assert not converted(llama, "model.embed_tokens.weight", (512, 64))
    assert not converted(gpt2, "transformer.h.0.attn.c_attn.weight", (192, 64))  # Conv1D
    assert not converted(mixtral, "model.layers.0.mlp.gate.weight", (16, 64))  # the router
    assert converted(mixtral, "model.layers.0.self_attn.q_proj.weight", (64, 64))
    assert converted(None, "model.layers.0.mlp.gate.weight", (16, 64))  # an nn.Linear torchao offers


@pytest.mark.slow
def test_converted_modules_are_torchaos():
    pytest.importorskip("torchao.float8")
    model = build_hf_model(dict(FAMILIES["llama"], intermediate_size=172), attention="sdpa")
    names = convert_float8(model, ImplSpec(float8="rowwise"))
    # q, k, v, o of both layers; the MLP's 172 is not a multiple of 16; the head is filtered
    assert names == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"


def test_fp8_cast_and_gathered_bytes():
    assert fp8_cast_bytes("tensorwise", 4096, 4096) == 16_777_220  # 4096·4096·1 + one fp32 scale
    assert fp8_cast_bytes("rowwise", 4096, 1024) == 4_210_688  # 4096·1024 + 4096·4
    impl, llama = ImplSpec(float8="tensorwise", float8_all_gather=True), spec_from_hf_config(FAMILIES["llama"])
    assert gathered_bytes_per_element(impl, llama, "model.layers.0.mlp.up_proj.weight", (176, 64), 2) == 1
    assert gathered_bytes_per_element(impl, llama, "model.layers.0.input_layernorm.weight", (64,), 2) == 2
    assert gathered_bytes_per_element(impl, llama, "lm_head.weight", (512, 64), 2) == 2
    assert gathered_bytes_per_element(ImplSpec(float8="tensorwise"), llama, "model.layers.0.mlp.up_proj.weight",
                                      (176, 64), 2) == 2


def test_amp_keeps_no_weight_copies_exact():
    """Under autocast nn.Linear keeps a bf16 copy of its weight; a Float8Linear does not."""
    cfg = FAMILIES["llama"]
    plain = _estimated(cfg, "amp-bf16", "sdpa", "none")
    fp8 = _estimated(cfg, "amp-bf16", "sdpa", "tensorwise")
    # per layer q, o 64·64, k, v 32·64, gate, up, down 176·64: 4096·2 + 2048·2 + 11264·3 = 46080
    # elements, 2 bytes each, 2 layers: 184320 bytes
    assert plain - fp8 == 184_320


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_llama_activations_equal_real_float8(recipe, precision):
    cfg = FAMILIES["llama"]
    assert _estimated(cfg, precision, "sdpa", recipe) == _kept_by_forward(cfg, recipe, precision, "sdpa")


CASES = [(f, p, a, r) for f in FAMILIES for p in ("fp32", "bf16", "amp-bf16") for a in ("eager", "sdpa")
         for r in ("tensorwise", "rowwise")]


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,attention,recipe", CASES)
def test_activations_equal_real_float8(family, precision, attention, recipe):
    cfg = FAMILIES[family]
    assert _estimated(cfg, precision, attention, recipe) == _kept_by_forward(cfg, recipe, precision, attention)


def test_op_policy_keeps_tensorwise_amax_scalars_exact():
    """torchtitan's policy keeps aten.max outputs: tensorwise's amax of each input and weight."""
    cfg = FAMILIES["llama"]
    rowwise = _estimated(cfg, "amp-bf16", "sdpa", "rowwise", "op")
    # 14 linears, each a bf16 input amax (2 bytes) and an fp32 weight amax (4 bytes): 14·6 = 84
    assert _estimated(cfg, "amp-bf16", "sdpa", "tensorwise", "op") - rowwise == 84


OP_CASES = [(f, p, r) for f in ("llama", "qwen2") for p in ("fp32", "bf16", "amp-bf16")
            for r in ("tensorwise", "rowwise")]


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,recipe", OP_CASES)
def test_op_checkpointing_equals_real_float8(family, precision, recipe):
    """Op-level checkpointing (torchtitan's policy) over torchao's Float8Linear: the fp8 mm counts as
    an mm (qwen2's biased q/k/v too: mm + add, not addmm), tensorwise's amax scalars are kept."""
    cfg = FAMILIES[family]
    assert (_estimated(cfg, precision, "sdpa", recipe, "op")
            == _kept_by_forward(cfg, recipe, precision, "sdpa", op_sac=True))


TRACE = dict(FAMILIES["llama"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_trace_fake_equals_real_and_estimate_within_one_percent(precision):
    pytest.importorskip("torchao.float8")
    step = StepSpec(batch=2, seq=32, precision=precision)
    impl = ImplSpec(attention="eager", device="cpu", float8="tensorwise", optimizer_impl="foreach")
    fake, real = trace_step(TRACE, step, impl), trace_step(TRACE, step, impl, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert len(real.meta["float8"]["converted"]) == 14  # 7 linears x 2 layers
    est = estimate(spec_from_hf_config(TRACE), step, impl)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (est.peak_bytes, real.peak_bytes)


def test_refusals_name_the_field():
    with pytest.raises(SpecError, match="float8='fp8'"):
        ImplSpec(float8="fp8")
    with pytest.raises(SpecError, match="float8_all_gather=True"):
        ImplSpec(float8="rowwise", float8_all_gather=True)
    # compile: the spec takes it; the estimate refuses what its compiled rules do not cover (test_float8_compiled.py)
    with pytest.raises(UnsupportedError, match="float8='tensorwise'"):
        estimate(spec_from_hf_config(TRACE), StepSpec(batch=1, seq=16, precision="bf16"),
                 ImplSpec(float8="tensorwise", compile=True))


@pytest.mark.slow  # builds a Hugging Face model (seconds)
def test_trace_refuses_the_fp8_all_gather():
    with pytest.raises(UnsupportedError, match="one device"):
        trace_step(TRACE, StepSpec(batch=1, seq=16, precision="bf16"),
                   ImplSpec(float8="tensorwise", float8_all_gather=True))


def test_fsdp_gathers_fp8_linear_weights_exact():
    """FSDP2 with torchao's fp8 all-gather: converted linear weights travel and stay unsharded in fp8."""
    from trainmem.specs import ParallelSpec
    model, step = spec_from_hf_config(FAMILIES["llama"]), StepSpec(batch=2, seq=64, precision="fsdp-bf16")

    def parts(impl, reshard):
        e = estimate(model, step, impl, ParallelSpec(dp=2, fsdp="full", reshard_after_forward=reshard))
        return {p.name: p.parts for p in e.phases}

    bf16 = parts(ImplSpec(), True)
    fp8 = parts(ImplSpec(float8="tensorwise", float8_all_gather=True), True)
    # one block: linears 46080 elements (q, o 64·64; k, v 32·64; gate, up, down 176·64), norms 2·64
    assert bf16["forward"]["fsdp_allgather"] == (46080 + 128) * 2 == 92416
    assert fp8["forward"]["fsdp_allgather"] == 46080 + 128 * 2 == 46336
    assert fp8["backward"]["fsdp_allgather"] == 2 * 46336  # current + prefetched block
    # the root (embedding, final norm, head: 512·64·2 + 64 elements) is not converted: bf16, gathered
    # whole beside its shard (estimate/parallel_buffers.py)
    assert fp8["forward"]["fsdp_root_unsharded"] == bf16["forward"]["fsdp_root_unsharded"] == (512 * 64 * 2 + 64) * 2
    kept = parts(ImplSpec(float8="tensorwise", float8_all_gather=True), False)
    assert kept["forward"]["fsdp_unsharded_params"] == (65600 + 2 * 128) * 2 + 2 * 46080 == 223872


def _titan(float8: dict, table: str = "float8", shard: int = 8) -> dict:
    from trainmem.inputs.torchtitan import torchtitan_overrides
    cfg = {"model": {"name": "llama3", "flavor": "8b", "converters": [table]},
           "parallelism": {"data_parallel_shard_degree": shard}}
    section = cfg
    for part in table.split("."):
        section = section.setdefault(part, {})
    section.update(float8)
    return torchtitan_overrides(cfg)


def test_torchtitan_float8_tables():
    a = _titan({"enable_fsdp_float8_all_gather": True, "filter_fqns": ["output"]})
    assert a["overrides"]["impl"]["float8"] == "tensorwise" and a["overrides"]["impl"]["float8_all_gather"]
    assert not any("filter_fqns" in n for n in a["notes"])
    b = _titan({"recipe_name": "rowwise"}, table="quantize.linear.float8")
    assert b["overrides"]["impl"]["float8"] == "rowwise" and "float8_all_gather" not in b["overrides"]["impl"]
    assert any("converts the output layer too" in n for n in b["notes"])
    c = _titan({"enable_fsdp_float8_all_gather": True, "filter_fqns": "output"}, shard=1)
    assert "float8_all_gather" not in c["overrides"]["impl"] and any("no FSDP" in n for n in c["notes"])
    with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather"):
        _titan({"recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True})


def test_advise_offers_float8_only_where_the_gpu_has_fp8():
    from trainmem.plan.choices import CHOICES, Config, Context
    from trainmem.plan.hardware import load_gpu
    from trainmem.specs import ParallelSpec
    model = spec_from_hf_config(FAMILIES["llama"])
    start = Config(StepSpec(batch=1, seq=64, precision="fsdp-bf16"), ImplSpec(), ParallelSpec(dp=8, fsdp="full"))
    offered = {g: [c.impl for c, _ in CHOICES["float8"].variants(
        start, Context(model, 8, 8, fp8=load_gpu(g).fp8_flops is not None))] for g in ("h100-80gb", "a100-80gb")}
    assert offered["a100-80gb"] == []
    assert [(i.float8, i.float8_all_gather) for i in offered["h100-80gb"]] == [("tensorwise", True), ("rowwise", False)]
    assert "--float8 tensorwise --float8-all-gather" in Config(start.step, offered["h100-80gb"][0], start.par).command("m")


def test_step_time_runs_converted_matmuls_at_the_fp8_rate():
    from trainmem.estimate.float8 import converted_parameters
    from trainmem.plan.cost import matmul_parameters, step_time
    from trainmem.plan.hardware import load_gpu
    from trainmem.specs import ParallelSpec
    model, step, par = spec_from_hf_config(FAMILIES["llama"]), StepSpec(batch=1, seq=64, precision="bf16"), ParallelSpec()
    assert converted_parameters(model) == 2 * 46080  # every block linear; embedding and head stay bf16
    h100, a100 = load_gpu("h100-80gb"), load_gpu("a100-80gb")
    t = {(g.name, f): step_time(model, step, ImplSpec(float8=f), par, g, global_batch=1).compute_s
         for g in (h100, a100) for f in ("none", "tensorwise")}
    assert t[("A100-80GB", "tensorwise")] == t[("A100-80GB", "none")]  # no FP8 rate: nothing changes
    assert t[("H100-80GB", "tensorwise")] < t[("H100-80GB", "none")]


@pytest.mark.parametrize("extra,impl", [
    ("", {"float8": "tensorwise", "float8_all_gather": True}),  # torchtune's default: tensorwise + fp8 all-gather
    ("fp8_recipe_name: rowwise\n", {"float8": "rowwise"}),
])
def test_torchtune_enable_fp8_training(tmp_path, extra, impl):
    from trainmem.inputs import read_torchtune
    p = tmp_path / "recipe.yaml"
    p.write_text("model:\n  _component_: torchtune.models.llama3.llama3_8b\ndtype: bf16\ndata_parallel_shard_dim: 8\n"
                 f"enable_fp8_training: true\n{extra}")
    assert read_torchtune(p)["overrides"]["impl"] == impl
    single = tmp_path / "single.yaml"  # no FSDP keys: a single-device recipe, which does not read it
    single.write_text("model:\n  _component_: torchtune.models.llama3.llama3_8b\nenable_fp8_training: true\n")
    a = read_torchtune(single)
    assert "float8" not in a["overrides"].get("impl", {}) and any("only full_finetune_distributed" in n for n in a["notes"])
