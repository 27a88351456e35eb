"""``--offload activations`` with LoRA: torchtune's ``OffloadActivations`` on a peft model.

torchtune offloads its LoRA and QLoRA recipes with the same context manager as its full fine-tunes
(recipes/lora_finetune_single_device.py: ``training.get_act_offloading_ctx_manager``). Checked on
CPU with real tensors: a transformers Llama built from config, peft LoRA, and the real hooks of
``trace/offload.py`` (torchtune's policy): what stays on the device after the forward equals the
estimate's device set to the byte, without and with full recompute.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.activation_offload import activation_offload  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.live import LiveStorages  # noqa: E402
from trainmem.trace.offload import offload_activations  # noqa: E402
from trainmem.trace.storages import storage_key  # noqa: E402

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=500)
B, S = 2, 64
FT = FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj", "down_proj"),
                  adapter_dtype="param")


FREEZE_NORM = FinetuneSpec(mode="full", freeze=("model.norm",))  # a trained last linear under a frozen final norm


def _forward_with_offload(recompute: str, use_streams: bool = False, ft: FinetuneSpec = FT):
    """(bytes a real bf16 forward + loss leaves on the device under torchtune's offload hooks, the hooks) for a
    peft-LoRA model (``ft.mode == "lora"``) or a fully trained one with ``ft.freeze``'s modules frozen: storages
    alive after it, the loss included (``loss.value``); with streams, the forward stash's too."""
    torch.manual_seed(0)
    base = build_hf_model(CFG, attention="sdpa", dtype=torch.bfloat16)
    if ft.mode == "lora":
        base.requires_grad_(False)
        model = peft.get_peft_model(base, peft.LoraConfig(r=ft.lora_rank, lora_alpha=ft.lora_alpha,
                                                          target_modules=list(ft.lora_targets)),
                                    autocast_adapter_dtype=False)  # adapters in bf16: adapter_dtype "param"
        region = model.get_base_model()  # the LlamaModel inside: head, loss out
    else:
        for name in ft.freeze:
            base.get_submodule(name).requires_grad_(False)
        model = region = base
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, CFG["vocab_size"], (B, S))
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with offload_activations(region, use_streams=use_streams) as off:
        with LiveStorages(skip_keys=skip) as live:
            loss = model(input_ids=ids, labels=ids).loss
        kept = live.now  # with the loss (the estimate's loss.value); a frozen embedding keeps no ids,
        if model.get_input_embeddings().weight.requires_grad:  # a trained one the caller's (skipped above)
            kept += ids.untyped_storage().nbytes()
        loss.backward()
    return kept, off


def _split(recompute: str, ft: FinetuneSpec = FT):
    return activation_offload(spec_from_hf_config(CFG), StepSpec(batch=B, seq=S, precision="bf16"),
                              ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=ft)


@pytest.mark.parametrize("recompute", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_lora_device_set_equals_real_offload(recompute):
    step, impl = StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(attention="sdpa", device="cpu",
                                                                      recompute=recompute)
    split = _split(recompute)
    assert split.device.total() == _forward_with_offload(recompute)[0]
    est = estimate(spec_from_hf_config(CFG), step, impl, ParallelSpec(offload=("activations",)), finetune=FT)
    plain = estimate(spec_from_hf_config(CFG), step, impl, finetune=FT)
    assert est.host.total() > 0
    # under full recompute the peak is the loss backward, where the forward stash still holds what went out
    # (the last block's input, the final norm's fp32 input): no lower than without offload, as traced
    assert est.peak_bytes < plain.peak_bytes if recompute == "none" else est.peak_bytes == plain.peak_bytes


STASH_CASES = [("none", FT), ("full", FT), ("none", FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16,
                                                                 lora_targets=("q_proj", "v_proj"),
                                                                 adapter_dtype="param")),
               ("none", FREEZE_NORM), ("full", FREEZE_NORM)]


@pytest.mark.parametrize("recompute,ft", [c if c == STASH_CASES[0] else pytest.param(*c, marks=pytest.mark.slow)
                                          for c in STASH_CASES])
def test_frozen_final_norm_stash_equals_real(recompute, ft):
    """A frozen final RMSNorm packs no normalized ``h``: its last offloaded pack is its fourth, so the forward
    stash (torchtune ``max_fwd_stash_size`` 5) keeps the last block's last pack too (activation_offload.py
    ``_block_packs_in_stash``): the ``lora_A`` output (LoRA down_proj), the block's input (full recompute), the
    trained down projection's input (``--freeze model.norm``), nothing of a frozen down projection
    (``weight.t()``). With streams the real hooks leave the device set plus exactly that stash; every device
    storage copied out equals the host figure, the frozen embedding's output under recompute included."""
    split = _split(recompute, ft)
    kept, off = _forward_with_offload(recompute, use_streams=False, ft=ft)
    kept_streams, _ = _forward_with_offload(recompute, use_streams=True, ft=ft)
    assert (split.device.total(), split.host_bytes, split.stash_bytes) == (kept, off.offloaded_storage_bytes,
                                                                           kept_streams - kept)


@pytest.mark.parametrize("recompute", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_lora_trace_offloads_what_the_estimate_sends_to_the_host(recompute):
    """``trace --finetune lora --offload activations`` runs the hooks on the LlamaModel inside the peft model
    (trace/offload.py ``offload_region`` unwraps ``get_base_model``). Before, it hooked peft's ``LoraModel`` tuner,
    whose hooks never fired: nothing was offloaded (packed_bytes 0) and the traced peak was the plain step's
    (1,771,720 B here). Now the trace's offloaded storages equal the estimate's host set (643,072 B without
    recompute; 65,536 B with full recompute, the frozen embedding's output packed by block 0's checkpoint
    included) and the step peaks are equal to the byte (1,163,464 B and 1,197,256 B, the loss backward). Before
    the frozen-norm stash and the caller's ids under offload were modelled the estimate was 3,072 B and 17,408 B
    under (docs/offload.md)."""
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(attention="sdpa", device="cpu",
                                                                      recompute=recompute)
    t = trace_step(CFG, step, impl, finetune=FT, offload=("activations",))
    est = estimate(spec_from_hf_config(CFG), step, impl, ParallelSpec(offload=("activations",)), finetune=FT)
    assert t.meta["offload"]["offloaded_storage_bytes"] == est.host.total()
    assert est.peak_bytes == t.peak_logical_bytes
    assert (est.host.total(), est.peak_bytes) == {"none": (643_072, 1_163_464), "full": (65_536, 1_197_256)}[recompute]
