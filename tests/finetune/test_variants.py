"""Fine-tuning variants that change what is stored and saved (issue 13, mechanism 7), on CPU.

Checked against the real libraries: which linears are 4-bit (``qlora_scope``, ``quantize_head``),
double quantization on and off (bitsandbytes 0.50.2 storage), torchao's NF4Tensor layout
(torchao 0.18.0), and peft's LoRA on fused projections (Phi-3 ``qkv_proj``/``gate_up_proj``,
GPT-NeoX ``query_key_value``, GPT-2's Conv1D ``c_attn``). Each compares the estimate with the
measured bytes exactly (==).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from trainmem.errors import SpecError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.estimate.finetune import quantized_module  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402

B, S = 2, 16
# every linear holds a multiple of 64·256 weights, as torchao's to_nf4 needs
LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=512)


def _real_bytes(model) -> int:
    """Parameter storages plus every quantization constant a 4-bit weight carries."""
    from test_qlora_bnb import _storage_bytes
    return _storage_bytes(model)


def _to_4bit(model, quantize, double_quant: bool) -> None:
    """Swap each nn.Linear that ``quantize(name)`` picks for bitsandbytes' Linear4bit (NF4),
    as transformers' bnb integration does for the modules it does not skip."""
    bnb = pytest.importorskip("bitsandbytes")
    for name, child in list(model.named_modules()):
        if not isinstance(child, torch.nn.Linear) or not quantize(name):
            continue
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                              compute_dtype=torch.bfloat16, compress_statistics=double_quant, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                     compress_statistics=double_quant)
        if q.weight.quant_state is None:
            q.weight._quantize("cpu")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)


def _qlora(cfg: dict, ft: FinetuneSpec):
    torch.manual_seed(0)
    model = build_hf_model(cfg, dtype=torch.bfloat16)
    _to_4bit(model, lambda name: quantized_module(name, ft), ft.double_quant)
    for p in model.parameters():
        p.requires_grad_(False)
    targets = "all-linear" if ft.lora_targets == ("all-linear",) else list(ft.lora_targets)
    model = peft.get_peft_model(model, peft.LoraConfig(r=ft.lora_rank, lora_alpha=ft.lora_alpha,
                                                       target_modules=targets, lora_dropout=ft.lora_dropout))
    model.train()
    return model


QLORA_CASES = [
    pytest.param("all", True, False, ("q_proj", "v_proj"), id="all-dq"),
    pytest.param("targeted", True, False, ("q_proj", "v_proj"), id="targeted-dq", marks=pytest.mark.slow),
    pytest.param("targeted", False, False, ("q_proj", "down_proj"), id="targeted-nodq", marks=pytest.mark.slow),
    pytest.param("all", False, True, ("all-linear",), id="all-nodq-head", marks=pytest.mark.slow),
    pytest.param("targeted", True, True, ("o_proj",), id="targeted-dq-head"),
]


@pytest.mark.parametrize("scope,double_quant,head,targets", QLORA_CASES)
def test_qlora_scope_double_quant_and_head_match_bitsandbytes(scope, double_quant, head, targets):
    ft = FinetuneSpec(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=targets, double_quant=double_quant,
                      qlora_scope=scope, quantize_head=head)
    model = _qlora(LLAMA, ft)
    ids = torch.randint(0, LLAMA["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()  # MatMul4Bit's backward ran on what was saved
    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=B, seq=S, precision="bf16")
    acts = activation_items(spec, step, ImplSpec(device="cpu"), ft)
    # with the loss the caller holds (not saved): the estimate's loss.value
    assert sum(i.bytes for i in acts) == sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()
    est = estimate(spec, step, ImplSpec(device="cpu"), finetune=ft)
    assert est.totals_bytes["parameter"] == _real_bytes(model)
    n4 = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert n4 == sum(1 for i in est.inventory if i.dtype == "nf4")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(), dict(qlora_scope="targeted", quantize_head=True), dict(double_quant=False)])
def test_real_trace_of_a_qlora_step_saves_what_the_estimate_says(variant):
    """trace_step on the bitsandbytes + peft model itself (real CPU tensors: Params4bit cannot be
    fake): what it records as saved for backward equals the estimate's activations to the byte."""
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"), **variant)
    step = StepSpec(batch=B, seq=S, precision="bf16")
    result = trace_step(_qlora(LLAMA, ft), step, ImplSpec(device="cpu"), real=True)
    saved = sum(i.bytes for i in result.items if i.category.value == "activation" and i.note == "saved for backward")
    est = estimate(spec_from_hf_config(LLAMA), step, ImplSpec(device="cpu"), finetune=ft)
    held = next(i.bytes for i in est.inventory if i.name == "loss.value")  # the caller's loss, not saved
    assert saved == est.totals_bytes["activation"] - held


def test_scope_and_double_quant_change_the_estimate_exactly():
    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=B, seq=S, precision="bf16")

    def params(**kw) -> int:
        ft = FinetuneSpec(mode="qlora", lora_targets=("q_proj", "v_proj"), **kw)
        return estimate(spec, step, ImplSpec(device="cpu"), finetune=ft).totals_bytes["parameter"]

    # targeted: k, o, gate, up, down stay bf16 in both blocks: 2·(2·128·128 + 3·128·256)·2 = 524288 bytes
    # instead of 4-bit: ⌈n/2⌉ + ⌈n/64⌉ + ⌈n/64/256⌉·4 + 4 + 1024 + 64 per weight
    four_bit = sum(n // 2 + n // 64 + -(-n // 16384) * 4 + 4 + 1024 + 64 for n in [16384] * 2 + [32768] * 3) * 2
    assert params(qlora_scope="targeted") - params() == 524288 - four_bit
    # no double quantization: absmax fp32 (n/64·4) instead of uint8 + fp32 per 256 + offset + map
    weights = [16384] * 4 + [32768] * 3
    dq = sum(n // 64 + -(-n // 16384) * 4 + 4 + 1024 for n in weights) * 2
    assert params(double_quant=False) - params() == sum(n // 64 * 4 for n in weights) * 2 - dq


def test_torchao_nf4_layout_matches_to_nf4():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    ft = FinetuneSpec(mode="qlora", quant_impl="torchao-nf4", lora_targets=("all-linear",))
    torch.manual_seed(0)
    model = build_hf_model(LLAMA, dtype=torch.bfloat16)
    measured = 0
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if p.dim() == 2 and "embed" not in name and quantized_module(module, ft):
            t = nf4.to_nf4(p.detach())
            measured += sum(getattr(t, k).untyped_storage().nbytes() for k in
                            ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"))
        else:
            measured += p.untyped_storage().nbytes()
    spec = spec_from_hf_config(LLAMA)
    est = estimate(spec, StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(device="cpu"), finetune=ft)
    adapters = sum(i.bytes for i in est.inventory if i.category.value == "parameter" and ".lora_" in i.name)
    assert est.totals_bytes["parameter"] - adapters == measured


def test_torchao_linear_nf4_saves_only_its_weight():
    """torchtune's FrozenNF4Linear / LoRALinear(quantize_base=True) call ``linear_nf4``: its
    autograd function saves the NF4 weight (a parameter), never the input -- as bitsandbytes."""
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    weight = torch.nn.Parameter(nf4.to_nf4(torch.randn(128, 128, dtype=torch.bfloat16)), requires_grad=False)
    holder = torch.nn.Module()
    holder.weight = weight
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16, requires_grad=True)
    saved, out = saved_tensors(holder, lambda: nf4.linear_nf4(x, weight))
    out.sum().backward()
    assert saved == [] and x.grad is not None


FUSED = {
    "phi3": (dict(model_type="phi3", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=500, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                  pad_token_id=0),
             ("qkv_proj", "gate_up_proj")),
    "gpt_neox": (dict(model_type="gpt_neox", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=500, hidden_dropout=0.0, attention_dropout=0.0),
                 ("query_key_value",)),
    "gpt2": (dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64, attn_pdrop=0.0,
                  resid_pdrop=0.0, embd_pdrop=0.0), ("c_attn",)),
}


@pytest.mark.parametrize("family", [f if f == "phi3" else pytest.param(f, marks=pytest.mark.slow) for f in FUSED])
def test_lora_on_fused_projections_matches_peft(family):
    cfg, targets = FUSED[family]
    torch.manual_seed(0)
    model = build_hf_model(cfg, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets),
                                                       fan_in_fan_out=family == "gpt2"))
    model.train()
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=targets)
    spec, step = spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision="bf16")
    acts = activation_items(spec, step, ImplSpec(device="cpu"), ft)
    # with the loss the caller holds (not saved): the estimate's loss.value
    assert sum(i.bytes for i in acts) == sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()
    est = estimate(spec, step, ImplSpec(device="cpu"), finetune=ft)
    real = {n.removeprefix("base_model.model."): tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    mine = {i.name: i.shape for i in est.inventory if i.category.value == "parameter" and ".lora_" in i.name}
    assert mine == real
    assert est.totals_bytes["parameter"] == sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_variant_refusals():
    with pytest.raises(SpecError, match="double_quant"):
        FinetuneSpec(mode="qlora", quant_impl="torchao-nf4", double_quant=False)
    with pytest.raises(SpecError, match="qlora_scope"):
        FinetuneSpec(mode="qlora", qlora_scope="some")
    spec, step = spec_from_hf_config({**LLAMA, "tie_word_embeddings": True}), StepSpec(batch=B, seq=S)
    with pytest.raises(SpecError, match="quantize_head"):
        estimate(spec, step, ImplSpec(), finetune=FinetuneSpec(mode="qlora", quantize_head=True))
    odd = spec_from_hf_config({**LLAMA, "num_key_value_heads": 2})  # k_proj: 64·128 weights
    with pytest.raises(SpecError, match="torchao-nf4"):
        estimate(odd, step, ImplSpec(), finetune=FinetuneSpec(mode="qlora", quant_impl="torchao-nf4"))


def test_dequantized_weights_sit_where_the_4bit_matmuls_run():
    """Blocks' 4-bit matmuls run in their backward; a 4-bit head's next to the bf16 logits (or their
    gradient), after the fp32 copies the phase counts are freed or before they exist."""
    from trainmem.estimate.block_backward import block_items
    from trainmem.estimate.quant4bit_moments import four_bit_mlp_moments

    spec, step = spec_from_hf_config(LLAMA), StepSpec(batch=B, seq=S, precision="bf16")
    e = estimate(spec, step, ImplSpec(device="cpu"), finetune=FinetuneSpec(mode="qlora", quantize_head=True))
    parts = {p.name: p.parts for p in e.phases}
    # largest block weight: gate/up/down 256·128·2 = 65536; head 512·128·2 = 131072; logits 2·16·512·2 = 32768
    # a block's dequantized weight sits in its 4-bit matmuls' moments (estimate/quant4bit_moments.py), not beside its
    # other nodes: the down projection's, the residual gradient, the product's gradient and the weight
    block = block_items(e.inventory, 1)
    acts = [i for i in block if i.category.value == "activation" and i.bytes]
    R, prod = B * S * 128 * 2, B * S * 256 * 2
    down, up = four_bit_mlp_moments(block, acts, residual_bytes=R, checkpointed=False)
    assert down["work"] == R + prod + 65536 and up["work"] == R + 2 * prod + 65536 + R
    # here the final RMSNorm's backward (no 4-bit matmul) tops the block phase: no dequantized weight beside it
    assert "dequant_temporary" not in parts["backward"] and "node_work" in parts["backward"]
    # forward: head + bf16 logits - (bf16 logits + their fp32 copy) = 131072 + 32768 - 98304
    assert parts["forward"]["dequant_temporary"] == 65536
    # loss backward: head + bf16 logits grad - the two fp32 grads (2·2·16·512·4) = 131072 + 32768 - 131072
    assert parts["backward_start"]["dequant_temporary"] == 32768
