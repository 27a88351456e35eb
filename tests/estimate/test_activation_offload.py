"""``--offload activations``: torchtune's ``OffloadActivations`` on one device.

Checked against the real mechanism on CPU (transformers models built from config, real tensors,
``saved_tensors_hooks`` with torchtune's policy: ``trace/offload.py``): what stays on the device
after the forward equals the estimate to the byte, with and without streams (the forward stash);
the device storages copied out equal the estimate's host figure; the fake-tensor trace equals the
real-tensor trace; the estimated step peak is within 2% of the traced one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.activation_offload import activation_offload
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.live import LiveStorages
from trainmem.trace.offload import OffloadActivations, offload_activations
from trainmem.trace.storages import storage_key

B, S = 2, 64
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)
FAMILIES = {"llama": dict(model_type="llama", **SMALL), "qwen2": dict(model_type="qwen2", **SMALL)}
OFFLOAD = ParallelSpec(offload=("activations",))


def _forward_with_offload(cfg: dict, precision: str, recompute: str, use_streams: bool, batch: int = B, seq: int = S,
                          compile_scope: str | None = None, every: int = 1):
    """(bytes the forward leaves on the device, the offload hooks) for one real forward + loss:
    the storages alive after it (the loss included: the estimate's ``loss.value``) plus the input ids,
    which the embedding keeps.
    ``compile_scope``: each decoder block (and with ``block-loss`` the loss) through the real
    ``torch.compile`` with the tracer's partitioning backend (``trace/compiled.py``), as torchtune's
    ``training.compile_model`` compiles each layer. ``recompute`` op / every-k / selective: set up as
    the tracer does (``trace/step.py``: torchtitan's op policy through ``context_fn``, every
    ``every``-th block, the attention core checkpointed)."""
    import contextlib
    from trainmem.trace.recompute import enable_recompute, selective_recompute
    torch.manual_seed(0)
    model = build_hf_model(cfg, attention="sdpa", dtype=torch.bfloat16 if precision == "bf16" else None)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif recompute in ("op", "every-k"):
        enable_recompute(model, ImplSpec(attention="sdpa", device="cpu", recompute=recompute,
                                          recompute_every=every))
    selective = selective_recompute(model, "sdpa") if recompute == "selective" else contextlib.nullcontext()
    if compile_scope is not None:
        from trainmem.trace.compiled import compile_model
        model, _ = compile_model(model, ImplSpec(attention="sdpa", device="cpu", compile=True,
                                                 compile_scope=compile_scope, recompute=recompute))
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    if compile_scope is not None:  # compiled once, before anything is measured
        with offload_activations(model, use_streams=use_streams):
            model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with selective, offload_activations(model, use_streams=use_streams) as off:
        with LiveStorages(skip_keys=skip) as live:
            loss = model(ids, labels=ids).loss
        kept = live.now + ids.untyped_storage().nbytes()
        loss.backward()
    assert not off.tracker and not off.bwd_stash and off.host.live_bytes == 0  # all brought back and freed
    return kept, off


def test_policy_on_torch_ops():
    """torchtune's pack test: >= 1024 bytes and not an nn.Parameter instance. A bias-free linear
    saves its input and ``weight.t()`` (a view: copied out); a 2-element mul's inputs stay."""
    lin = torch.nn.Linear(16, 16, bias=False)  # weight 16·16·4 = 1024 bytes
    x = torch.randn(32, 16, requires_grad=True)  # 32·16·4 = 2048 bytes
    small = torch.randn(2, requires_grad=True)
    hooks = OffloadActivations(use_streams=False)
    with hooks:
        y = lin(x)
        z = small * small
    # copied: x (2048) and weight.t() (1024); kept: small, twice (2·8 bytes)
    assert hooks.offloaded_bytes == 2048 + 1024
    assert hooks.packed_bytes == 2048 + 1024 + 2 * 8
    assert hooks.host.live_bytes == 3072
    (y.sum() + z.sum()).backward()
    assert hooks.host.live_bytes == 0 and torch.equal(lin.weight.grad, torch.ones(32, 16).t() @ x)


def test_llama_fp32_device_set_exact():
    sp = activation_offload(spec_from_hf_config(FAMILIES["llama"]), StepSpec(batch=B, seq=S, precision="fp32"),
                            ImplSpec(attention="sdpa", device="cpu"))
    # kept: ids B·S·8 = 1024; five norm rsqrt B·S·4 = 512 < 1024 each; the head's input B·S·H·4 = 32768;
    # log_softmax B·S·V·4 = 256000, the target B·S·8 = 1024, the total weight 4, the loss value 4
    assert sp.device.total() == 1024 + 5 * 512 + 32768 + 256000 + 1024 + 4 + 4
    # the forward stash: the final norm's input and normalized tensor, 2·B·S·H·4
    assert sp.stash_bytes == 2 * 32768
    assert sp.reasons["model.layers.0.input_layernorm.rsqrt"].startswith("smaller than")


CASES = [(f, p, r) for f in FAMILIES for p in ("fp32", "bf16") for r in ("none", "full")]
FAST = ("qwen2", "bf16", "none")


@pytest.mark.parametrize("family,precision,recompute",
                         [c if c == FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_device_set_equals_real_offload(family, precision, recompute):
    cfg = FAMILIES[family]
    sp = activation_offload(spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
                            ImplSpec(attention="sdpa", device="cpu", recompute=recompute))
    kept, off = _forward_with_offload(cfg, precision, recompute, use_streams=False)
    assert sp.device.total() == kept
    # every device storage copied out, once each (the caller's ids too)
    assert sp.host_bytes == off.offloaded_storage_bytes
    kept_streams, _ = _forward_with_offload(cfg, precision, recompute, use_streams=True)
    assert sp.device.total() + sp.stash_bytes == kept_streams


GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2_layernorm_stash(precision):
    """GPT-2's final LayerNorm packs input, weight, bias, mean, rstd: with mean and rstd of 1024
    bytes or more (B·S = 4·128 = 512 rows) the last five packs are the norm's own."""
    sp = activation_offload(spec_from_hf_config(GPT2), StepSpec(batch=4, seq=128, precision=precision),
                            ImplSpec(attention="sdpa", device="cpu"))
    kept, off = _forward_with_offload(GPT2, precision, "none", use_streams=False, batch=4, seq=128)
    kept_streams, _ = _forward_with_offload(GPT2, precision, "none", use_streams=True, batch=4, seq=128)
    assert (sp.device.total(), sp.host_bytes, sp.stash_bytes) == (kept, off.offloaded_storage_bytes,
                                                                   kept_streams - kept)


LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=500)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trace_on_fake_tensors_equals_real(precision):
    step = StepSpec(batch=2, seq=128, precision=precision)
    impl = ImplSpec(attention="eager", device="cpu")
    fake = trace_step(LLAMA, step, impl, offload=("activations",))
    real = trace_step(LLAMA, step, impl, real=True, offload=("activations",))
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert fake.meta["offload"] == real.meta["offload"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_peak_within_two_percent_of_trace(precision):
    step = StepSpec(batch=2, seq=256, precision=precision)
    impl = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="foreach")
    traced = trace_step(LLAMA, step, impl, offload=("activations",))
    est = estimate(spec_from_hf_config(LLAMA), step, impl, OFFLOAD)
    assert abs(est.peak_bytes - traced.peak_logical_bytes) <= 0.02 * traced.peak_logical_bytes, (
        est.peak_bytes, traced.peak_logical_bytes, est.peak_phase)
    plain = trace_step(LLAMA, step, impl)
    assert traced.peak_bytes < plain.peak_bytes
    # host: the estimate counts each storage once; torchtune copies every pack (weights' views too)
    assert est.host.total() == traced.meta["offload"]["offloaded_storage_bytes"]
    assert traced.meta["offload"]["offloaded_bytes"] > est.host.total()


def test_estimate_reports_host_and_keeps_it_off_the_device():
    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=256, precision="bf16")
    plain, off = estimate(spec, step, ImplSpec()), estimate(spec, step, ImplSpec(), OFFLOAD)
    assert off.peak_bytes < plain.peak_bytes
    d = off.to_dict(items=False)
    assert d["host_bytes"]["offloaded_activations"] == off.host.total() > 0
    assert "host_bytes" not in plain.to_dict(items=False)


def test_refused_where_not_modelled():
    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=256, precision="bf16")
    with pytest.raises(SpecError, match="compile-scope"):  # torchtune compiles each layer
        estimate(spec, step, ImplSpec(compile=True, compile_scope="model"), OFFLOAD)
    with pytest.raises(SpecError, match="offload"):
        estimate(spec, step, ImplSpec(profile="reference"), OFFLOAD)


def _exact(cfg, precision, impl, *, seq=S, **real):
    """The estimate's device set, host figure and forward stash == the real forward's."""
    sp = activation_offload(spec_from_hf_config(cfg), StepSpec(batch=B, seq=seq, precision=precision), impl)
    recompute = impl.recompute
    kept, off = _forward_with_offload(cfg, precision, recompute, use_streams=False, seq=seq, **real)
    kept_streams, _ = _forward_with_offload(cfg, precision, recompute, use_streams=True, seq=seq, **real)
    assert (sp.device.total(), sp.host_bytes, sp.stash_bytes) == (kept, off.offloaded_storage_bytes,
                                                                   kept_streams - kept)


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,recompute,every,seq", [
    ("llama", "bf16", "op", 1, S), ("qwen2", "fp32", "op", 1, S),
    ("llama", "fp32", "every-k", 2, S), ("qwen2", "bf16", "every-k", 2, S),
    ("llama", "fp32", "selective", 1, 256), ("llama", "bf16", "selective", 1, 256)])
def test_recompute_modes_device_set_equals_real(family, precision, recompute, every, seq):
    """torchtune's ac_mode/ac_option: op's policy outputs stay in the SAC cache (inside the
    checkpoint's own hooks); every-k's eager blocks pack the rotary cos/sin its checkpoints' closures
    hold (copied out, kept); selective packs q, k, v but not position_ids (a keyword: S=256 makes
    it 4096 bytes, over min_offload_size)."""
    _exact(FAMILIES[family], precision, ImplSpec(attention="sdpa", device="cpu", recompute=recompute,
                                                 recompute_every=every), seq=seq, every=every)


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,recompute,scope", [
    ("llama", "bf16", "none", "block"), ("qwen2", "fp32", "none", "block"),
    ("qwen2", "bf16", "none", "block-loss"), ("llama", "fp32", "full", "block")])
def test_compiled_blocks_device_set_equals_real(family, precision, recompute, scope):
    """torchtune's compile_model + OffloadActivations: each compiled block's CompiledFunction saves
    its partitioned set through ctx.save_for_backward, so the pack hook sees what the min-cut kept
    (primals that are parameters stay); under --recompute full the CPU generator state each block
    saves is copied too. ~1-2 min each (compiles)."""
    _exact(FAMILIES[family], precision, ImplSpec(attention="sdpa", device="cpu", recompute=recompute, compile=True,
                                                 compile_scope=scope), compile_scope=scope)


@pytest.mark.slow
@pytest.mark.parametrize("precision,recompute,scope", [
    ("fp32", "op", None), ("bf16", "op", None), ("fp32", "selective", None), ("bf16", "selective", None),
    ("bf16", "none", "block")])
def test_recompute_and_compile_against_the_trace(precision, recompute, scope):
    """The host figure == the tracer's device storages copied out; the step peak within 2% of the
    trace for op and selective. Per-block compile: the host figure only (the compiled block's own
    backward working set, fp32 upcasts of its B·S·F pointwise grads, is not in the phases: the
    estimate's peak is 0.76-0.89 of the trace there; docs/offload.md)."""
    step = StepSpec(batch=2, seq=256, precision=precision)
    kw = dict(compile=True, compile_scope=scope) if scope else {}
    impl = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="foreach", recompute=recompute, **kw)
    traced = trace_step(LLAMA, step, impl, offload=("activations",))
    est = estimate(spec_from_hf_config(LLAMA), step, impl, OFFLOAD)
    assert est.host.total() == traced.meta["offload"]["offloaded_storage_bytes"]
    if scope is None:
        assert abs(est.peak_bytes - traced.peak_logical_bytes) <= 0.02 * traced.peak_logical_bytes, (
            est.peak_bytes, traced.peak_logical_bytes, est.peak_phase)


RECIPE = ("model:\n  _component_: torchtune.models.llama2.llama2_7b\ndtype: bf16\nbatch_size: 2\n"
          "enable_activation_checkpointing: True\nenable_activation_offloading: True\n")


def test_torchtune_recipe_offloads_on_one_device(tmp_path):
    from trainmem.inputs import read_torchtune
    p = tmp_path / "low_memory.yaml"
    p.write_text(RECIPE)  # recipes/configs/llama2/7B_full_low_memory.yaml's settings
    assert read_torchtune(p)["overrides"]["parallel"] == {"offload": ("activations",)}
    p.write_text(RECIPE.replace("llama2_7b", "lora_llama2_7b\n  lora_attn_modules: ['q_proj']"))
    a = read_torchtune(p)
    assert "offload" not in a["overrides"].get("parallel", {})
    assert any(n.startswith("enable_activation_offloading: modelled on one device") for n in a["notes"])


def test_cli_json_has_the_host_figure(capsys):
    import json
    from trainmem.cli import main
    argv = ["estimate", "--model", "llama-2-7b", "--batch", "2", "--seq", "4096", "--precision", "bf16", "--json"]
    assert main(argv + ["--offload", "activations"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert off["host_bytes"]["offloaded_activations"] > 0 and "host_bytes" not in plain
    assert off["peak_bytes"] < plain["peak_bytes"]


def test_advise_prices_the_host_figure():
    """advise's offload choice moves what the estimate sends to host (out and back over PCIe,
    hidden behind compute where it can be: plan/cost.py step_time)."""
    from trainmem.plan.advise import _Measure
    from trainmem.plan.choices import Config
    from trainmem.plan.cost import step_time
    from trainmem.plan.hardware import GPU
    from trainmem.specs.loaders import load_model

    m = load_model("llama-2-7b")
    step = StepSpec(batch=2, seq=4096, precision="bf16")
    c = Config(step, ImplSpec(), OFFLOAD)
    measure = _Measure(m)
    peak, _, _ = measure(c)  # (allocated, activation, reserved)
    host = measure.host[c]
    assert host == estimate(m, step, ImplSpec(), OFFLOAD).host.total() and peak < measure(Config(step, ImplSpec(), ParallelSpec()))[0]
    slow = GPU(name="x", memory_bytes=1 << 36, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
               inter_node_bytes_per_s=1e10, host_bytes_per_s=1e9, gpus_per_node=8)
    t = step_time(m, step, ImplSpec(), OFFLOAD, slow, global_batch=2, offloaded_activation_bytes=host)
    # out and back at 1 GB/s, less the compute it overlaps: 2·host/1e9 - compute
    assert t.offload_s == pytest.approx(2 * host / 1e9 - t.compute_s)


@pytest.mark.slow
def test_trace_cli_prints_the_host_figure(tmp_path, capsys):
    import json
    from trainmem.cli import main
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["llama"]))
    assert main(["trace", "--model", str(cfg), "--batch", "2", "--seq", "64", "--offload", "activations"]) == 0
    out = capsys.readouterr().out
    assert "activations offloaded" in out and "offloaded to host (not in the peak)" in out
    assert main(["trace", "--model", str(cfg), "--offload", "optimizer"]) == 2
    assert "--offload optimizer" in capsys.readouterr().err
