"""plan --search (issue 13): compile, Float8, optimizer variants and activation offload as opt-in axes of
the layout search. Every candidate's peak is the estimate's for the same flags, to the byte (as
tests/plan/test_plan_op_recompute.py checks for op recompute); combinations the estimator refuses are
skipped with its reason; the default search is unchanged."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.axes import saved_sets
from trainmem.plan.hardware import load_gpu
from trainmem.plan.search import SearchSpace, plan
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

# a two-block Llama (SwiGLU, GQA): the compiled rules cover it, estimates take milliseconds
TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SEQ = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _specs(cfg: dict):
    step = StepSpec(batch=cfg["micro_batch"], seq=SEQ, grad_accum=cfg["grad_accum"],
                    optimizer=cfg.get("optimizer", "adamw"))
    impl = ImplSpec(attention=cfg["attention"], recompute=cfg["recompute"], compile=cfg.get("compile", False),
                    compile_scope=cfg.get("compile_scope", "model"), float8=cfg.get("float8", "none"),
                    optimizer_impl=cfg.get("optimizer_impl", "auto"),
                    optimizer_in_backward=cfg.get("optimizer_in_backward", False))
    par = ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], cp=cfg["cp"], pp=cfg["pp"], zero=cfg["zero"],
                       microbatches=cfg["grad_accum"], offload=tuple(cfg["offload"]))
    return step, impl, None if par.is_single else par


def _flags(model: str, cfg: dict) -> list[str]:
    """The ``trainmem estimate`` flags of a plan configuration."""
    out = ["estimate", "--model", model, "--batch", str(cfg["micro_batch"]), "--seq", str(SEQ),
           "--grad-accum", str(cfg["grad_accum"]), "--attention", cfg["attention"], "--recompute", cfg["recompute"],
           "--optimizer", cfg.get("optimizer", "adamw"), "--optimizer-impl", cfg.get("optimizer_impl", "auto"),
           "--float8", cfg.get("float8", "none"), "--dp", str(cfg["dp"]), "--tp", str(cfg["tp"]),
           "--zero", str(cfg["zero"])]
    out += ["--sp"] if cfg["sp"] else []
    out += ["--offload", ",".join(cfg["offload"])] if cfg["offload"] else []
    out += ["--compile", "--compile-scope", cfg["compile_scope"]] if cfg.get("compile") else []
    return out + (["--optimizer-in-backward"] if cfg.get("optimizer_in_backward") else []) + ["--json"]


def _check_exact(model_path: str, data: dict, capsys) -> None:
    model = load_model(model_path)
    shown = data["candidates"] + data["pareto"]
    assert shown
    for c in shown:
        assert c["peak_bytes"] == estimate(model, *_specs(c["config"])).peak_bytes, c["config"]
    assert main(_flags(model_path, shown[0]["config"])) == 0  # the printed estimate, for the first one
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == shown[0]["peak_bytes"]


def test_compile_and_float8_axes_peaks_are_the_estimates_and_refusals_say_why(tiny, capsys):
    assert main(["plan", "--model", tiny, "--seq", str(SEQ), "--global-batch", "4", "--gpu", "h100-80gb",
                 "--gpus", "2", "--search", "compile,float8", "--recompute", "none", "--recompute", "selective",
                 "--top", "3", "--json", "--rejected"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["search"]["axes"] == ["compile", "float8"]
    assert {c["config"]["compile"] for c in data["candidates"]} == {True}  # compile unpriced: ties, fewer bytes
    assert all(c["config"]["float8"] != "none" for c in data["candidates"])  # the FP8 rate is priced
    _check_exact(tiny, data, capsys)
    skipped = {s["why"].split(" is not modelled")[0] for s in data["search"]["skipped_variants"]}
    assert "compile: attention='eager'" in skipped  # the estimator's own refusal, once per saved set
    reasons = {r["reason"] for r in data["rejected"]}
    assert any(r.startswith("compile is modelled on one device's shapes, not tp=2") for r in reasons)
    # Float8 tensorwise under TP with selective recompute: the estimator's validate (estimate/parallel.py)
    assert any(r.startswith("float8='tensorwise': with tp=2") for r in reasons)


def test_one_device_axes_in_backward_and_activation_offload(tiny, capsys):
    assert main(["plan", "--model", tiny, "--seq", str(SEQ), "--global-batch", "2", "--gpu", "h100-80gb",
                 "--gpus", "1", "--search", "optimizer-in-backward,offload-activations", "--attention", "flash",
                 "--top", "8", "--json", "--rejected"]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_exact(tiny, data, capsys)
    configs = [c["config"] for c in data["candidates"] + data["pareto"]]  # offload is slower: on the front
    assert any(c["optimizer_in_backward"] for c in configs) and any("activations" in c["offload"] for c in configs)
    assert any(r["reason"].startswith("optimizer in backward needs gradient accumulation 1, not 2")
               for r in data["rejected"])


def test_one_device_screen_is_below_the_estimate(tiny):
    # the screen extrapolates each phase from micro-batch 1 and 2; the estimator decides what is shown
    model, base = load_model(tiny), StepSpec(batch=1, seq=SEQ)
    kernels = saved_sets(model, base, "hf", ("flash",), ("none",), ("optimizer-in-backward", "offload-activations"))[0]
    for kern in kernels.values():
        if not kern.variant.one_device:
            continue
        for mb, accum in ((3, 1), (5, 1), (3, 2)):
            if accum > 1 and kern.impl.optimizer_in_backward:
                continue
            e = estimate(model, StepSpec(batch=mb, seq=SEQ, grad_accum=accum), kern.impl, kern.par)
            assert 0 <= e.peak_bytes - kern.estimated(model, mb, accum, None)[0] <= 64 * mb


def test_default_search_has_no_axes_and_a_bad_axis_is_one_line(tiny, capsys):
    p = plan(load_model(tiny), seq=SEQ, global_batch=2, gpu=load_gpu("h100-80gb"), gpus=1)
    assert "axes" not in p.stats and all("compile" not in c.config for c in p.candidates)
    assert p.stats["kernel_sets"] and all(len(k) == 2 for k in p.stats["kernel_sets"])
    assert main(["plan", "--model", tiny, "--gpu", "h100-80gb", "--gpus", "1", "--search", "compile,banana"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "search='banana'" in err[0] and "compile" in err[0]


@pytest.mark.slow
def test_llama_3_8b_on_8_gpus_with_compile_and_float8(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "8", "--search", "compile,float8",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = load_model("llama-3-8b")
    for c in data["candidates"] + data["pareto"]:
        step, impl, par = _specs(c["config"])
        step = StepSpec(batch=step.batch, seq=data["inputs"]["step"]["seq"], grad_accum=step.grad_accum,
                        optimizer=step.optimizer)
        assert c["peak_bytes"] == estimate(model, step, impl, par).peak_bytes, c["config"]
