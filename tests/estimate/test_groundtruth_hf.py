"""The estimator against what PyTorch really saves, on real Hugging Face models built from config.

Measured: saved_tensors_hooks (distinct storages, parameters excluded) without checkpointing,
live-storage tracking with it (hooks cannot see inside checkpointed regions); both with the 0-dim
loss the caller holds, which the estimate lists as ``loss.value`` (estimate/loss_value.py).
Activations agree to the byte in every case; each step peak has its own measured window, with the
reason beside it (PEAK_CASES). Failures name the tensors that differ.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace.live import LiveStorages
from trainmem.trace.saved import explain_difference, saved_tensors, step_peak_bytes
from trainmem.trace.storages import storage_key

B, S = 2, 32
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)
FAMILIES = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64),
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),  # GQA + q/k/v bias
    "mistral": dict(model_type="mistral", **SMALL),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **SMALL),
}
DROPOUT_KEYS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


def _config(family: str, dropout: float) -> dict:
    cfg = dict(FAMILIES[family])
    for key in DROPOUT_KEYS.get(family, ("attention_dropout",)):
        cfg[key] = dropout
    return cfg


def _measure(cfg: dict, precision: str, attention: str, recompute: str) -> tuple[int, list]:
    torch.manual_seed(0)
    dtype = getattr(torch, TORCH_DTYPE[precision]) if precision in TORCH_DTYPE else None
    model = build_hf_model(cfg, attention=attention, dtype=dtype)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    amp = {"amp-bf16": torch.bfloat16}.get(precision)

    def forward():
        if amp:
            with torch.autocast("cpu", dtype=amp):
                return model(ids, labels=ids).loss
        return model(ids, labels=ids).loss

    saved, loss = saved_tensors(model, forward)
    held = loss.untyped_storage().nbytes()  # the loss the caller holds (not saved): the item loss.value
    del loss
    if recompute == "none":
        return sum(s.nbytes for s in saved) + held, saved
    # live storages created by the forward: the input ids are skipped there (GPT-2 views them, so
    # their storage is an op's output and was counted twice) and added once: the embedding saves
    # them; the loss is not saved but alive, as the estimate's loss.value
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with LiveStorages(skip_keys=skip) as live:
        loss = forward()
    assert loss.untyped_storage().nbytes() == held
    return live.now + ids.untyped_storage().nbytes(), saved


CASES = [
    (family, precision, attention, recompute, dropout)
    for family in FAMILIES
    for precision in ("fp32", "bf16", "amp-bf16")
    for attention in ("eager", "sdpa")
    for recompute in ("none", "full")
    for dropout in (0.0, 0.1)
    if not (dropout and family == "mixtral")  # Mixtral has no attention dropout in training configs we test
]


@pytest.mark.parametrize("family,precision,attention,recompute,dropout", CASES)
def test_activations_match_pytorch(family, precision, attention, recompute, dropout):
    cfg = _config(family, dropout)
    measured, saved = _measure(cfg, precision, attention, recompute)
    items = activation_items(
        spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
        ImplSpec(attention=attention, recompute=recompute, device="cpu"),
    )
    estimated = sum(i.bytes for i in items)
    assert estimated == measured, (
        f"estimate {estimated} vs measured {measured} ({estimated / measured:.4f}); {explain_difference(items, saved)}"
    )


# Measured on torch 2.13.0 (CPU live set, every storage to the byte); (lo, hi) bounds estimate − measured:
PEAK_CASES = [
    # (config overrides, B, S, precision, attention, recompute, (lo, hi) in bytes)
    # peak at the loss backward (backward_start): the estimate is 8,072 B over in fp32 and amp-bf16 sdpa
    # (re-measured 2026-12-01 with the loss value counted, estimate/loss_value.py; 7,940 B when written), under
    # 0.01%: it still counts the loss's saved target and total weight (4,100 B), which nll_loss's backward
    # has freed when log_softmax's backward allocates; the other ~3.9 kB are not identified yet
    (dict(vocab_size=8000), 2, 256, "fp32", "sdpa", "none", (0, 8192)),
    (dict(vocab_size=8000), 2, 256, "amp-bf16", "sdpa", "none", (0, 8192)),
    (dict(vocab_size=8000), 2, 256, "bf16", "eager", "full", (0, 8192)),
    # peak inside a block's backward: 256,240 B over (0.79%), less than one B×S×H fp32 tensor
    # (262,144 B): the phase's "recompute_and_work" is the block's whole backward working set at once,
    # while autograd frees some of its tensors before the largest gradient is allocated
    (dict(vocab_size=256), 2, 256, "fp32", "eager", "none", (0, 262144)),
    # peak in the optimizer step: 388 B over = the caller's ids (1 x 64 x 8 = 512 B), which the estimate's optimizer
    # phase counts (the loop holds the batch through opt.step()) and step_peak_bytes does not see (made before the
    # step, not a model state), less 124 B: small tensors foreach AdamW creates during step() (per-parameter
    # scalars) that the estimator does not list (252 B before it counted the model's rotary buffers, 2 x 16 fp32)
    (dict(vocab_size=256), 1, 64, "fp32", "sdpa", "full", (512 - 256, 512)),
]


@pytest.mark.slow  # 10-30 s on 2 shared cores: the default run is at its 10-minute budget
@pytest.mark.parametrize("over,b,s,precision,attention,recompute,window", PEAK_CASES)
def test_step_peak_matches_pytorch(over, b, s, precision, attention, recompute, window):
    cfg = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    cfg.update(over)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else None
    model = build_hf_model(cfg, attention=attention, dtype=dtype)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # CUDA's default
    ids = torch.randint(0, cfg["vocab_size"], (b, s))
    amp = torch.bfloat16 if precision == "amp-bf16" else None

    def step():
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on: the steady state the estimator models
    measured = step_peak_bytes(model, opt, step)
    est = estimate(spec_from_hf_config(cfg), StepSpec(batch=b, seq=s, precision=precision),
                   ImplSpec(attention=attention, recompute=recompute, device="cpu", optimizer_impl="foreach"))
    lo, hi = window
    assert lo <= est.peak_bytes - measured <= hi, (
        f"peak estimate {est.peak_bytes} ({est.peak_phase}) vs measured {measured}: "
        + ", ".join(f"{p.name}={p.bytes}" for p in est.phases)
    )
