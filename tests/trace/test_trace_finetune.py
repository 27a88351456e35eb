"""trace --finetune: peft LoRA and frozen parameters on the fake model; bnb-legacy QLoRA and parallel flags refused.

Fake == real to the byte for the whole step (eager attention: with SDPA and recompute the fake and
the real CPU runs differ already without fine-tuning, a backward-only difference this file does
not add to). What fine-tuning adds to the parameters, and the optimizer states, equal the
estimator's ledgers to the byte once each tensor is rounded as the tracer rounds an allocation
(512 B, the CUDA caching allocator's granularity): the same parameters train and the adapters have
the same dtype. (The trace's parameter figure is 1,024 B above the estimate's rounded one for this
config without fine-tuning too; the test compares what fine-tuning changes.)
"""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from trainmem.cli import main  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=500, max_position_embeddings=256)
CASES = [  # slow: ~3 s each alone, more under load (a fake and a real trace, then a baseline)
    pytest.param("fp32", FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16), "none", marks=pytest.mark.slow),
    pytest.param("bf16", FinetuneSpec(mode="lora", lora_targets=("all-linear",)), "full",  # adapters upcast to fp32
                 marks=pytest.mark.slow),
    pytest.param("amp-bf16", FinetuneSpec(mode="lora", adapter_dtype="param"), "none", marks=pytest.mark.slow),
    pytest.param("fp32", FinetuneSpec(freeze=("embeddings", "layers.0")), "full", marks=pytest.mark.slow),
]


def _rounded(est, category: Category) -> int:
    return sum(-(-item.bytes // 512) * 512 for item in est.inventory.items if item.category == category)


def _param_bytes(step, impl, ft):
    traced = trace_step(CFG, step, impl, finetune=ft).totals_at_peak_bytes["parameter"]
    return traced, _rounded(estimate(spec_from_hf_config(CFG), step, impl, finetune=ft), Category.PARAMETER)


@pytest.mark.parametrize("precision,ft,recompute", CASES, ids=lambda c: str(getattr(c, "mode", c)))
def test_fake_equals_real_and_states_equal_the_estimate(precision, ft, recompute):
    step, impl = StepSpec(batch=2, seq=32, precision=precision), ImplSpec(attention="eager", recompute=recompute)
    fake = trace_step(CFG, step, impl, finetune=ft)
    real = trace_step(CFG, step, impl, finetune=ft, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    est = estimate(spec_from_hf_config(CFG), step, impl, finetune=ft)
    base_traced, base_est = _param_bytes(step, impl, None)
    assert fake.totals_at_peak_bytes["parameter"] - base_traced == _rounded(est, Category.PARAMETER) - base_est
    assert fake.totals_at_peak_bytes["optimizer_state"] == _rounded(est, Category.OPTIMIZER_STATE)
    # the echo names the LoRA targets the run used (the family's default where the spec left them None)
    assert fake.meta["finetune"] == ft.for_model(spec_from_hf_config(CFG)).to_dict()


def test_lora_trains_only_the_adapters():
    # q_proj and v_proj of 2 layers, r=8: A (8x64) + B (64x8) for q, A (8x64) + B (32x8) for v (2 KV heads)
    # = (512 + 512 + 512 + 256) x 2 layers = 3584 fp32 parameters; AdamW keeps 2 states each: 3584 x 4 x 2
    step = StepSpec(batch=1, seq=16, precision="fp32")
    r = trace_step(CFG, step, ImplSpec(attention="eager"), finetune=FinetuneSpec(mode="lora"))
    assert r.totals_at_peak_bytes["optimizer_state"] == 3584 * 4 * 2


def _cli(capsys, *argv):
    rc = main(["trace", "--model", "llama-3-8b", "--seq", "16", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,flag", [
    (["--tp", "4", "--cp", "2"], "--cp 2"), (["--dp", "8"], "--dp 8"), (["--zero", "3"], "--zero 3"),
    (["--fsdp", "full"], "--fsdp full"), (["--pp", "2", "--microbatches", "2", "--grad-accum", "2"], "--grad-accum 2"), (["--sp"], "--sp"),
    (["--offload", "optimizer"], "--offload optimizer"),
    (["--finetune", "qlora", "--quant-impl", "bnb-legacy"], "--quant-impl bnb-legacy"),  # qlora: test_trace_qlora.py
])
def test_what_the_trace_cannot_run_is_one_line(capsys, argv, flag):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and flag in err


def test_trace_cli_lora_json_and_text(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CFG))
    rc = main(["trace", "--model", str(cfg), "--seq", "32", "--finetune", "lora", "--lora-rank", "4", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0 and json.loads(out)["inputs"]["finetune"]["lora_rank"] == 4
    rc = main(["trace", "--model", str(cfg), "--seq", "32", "--freeze", "embeddings", "--tp", "1"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.startswith("trace: LlamaForCausalLM, batch 1, seq 32") and "finetune full" in out


def test_advise_takes_the_finetuning_flags(capsys):
    # advise starts from estimate's own peak for the same flags, and its reproduce line keeps them
    argv = ["--model", "llama-3-8b", "--seq", "8192", "--finetune", "lora", "--lora-rank", "16"]
    assert main(["advise", *argv, "--gpu", "H100-80GB", "--json"]) == 0
    advised = json.loads(capsys.readouterr().out)
    assert main(["estimate", *argv, "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert advised["inputs"]["finetune"]["lora_rank"] == 16
    assert advised["start_peak_bytes"] == estimated["peak_bytes"]
    assert "--finetune lora" in advised["start_command"] and "--lora-rank 16" in advised["start_command"]
