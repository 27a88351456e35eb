"""--framework litgpt (estimate/rules_litgpt.py): LitGPT's own Llama block, checked to the byte.

The slow test runs litgpt's real ``GPT`` (``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable``
for LoRA, ``litgpt.model.GPT`` for a full fine-tune) in bf16 on CPU under saved-tensor hooks and
compares, block by block, the storages autograd keeps (parameters and buffers apart, de-duplicated
by storage) with the estimate's items of the same block. litgpt is optional (``pip install --no-deps
litgpt==0.5.13`` plus ``lightning``): skipped without it. Its import alone takes ~10 s of CPU.
"""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

H, A, F, V, B, S, R = 128, 4, 256, 512, 2, 32, 8
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def _cfg(kv: int) -> dict:
    return dict(model_type="llama", hidden_size=H, intermediate_size=F, num_hidden_layers=2, num_attention_heads=A,
                num_key_value_heads=kv, vocab_size=V)


def _finetune(targets: str, dropout: float) -> FinetuneSpec | None:
    if targets == "full":
        return None
    names = [HF_NAMES[t] for t in targets if t in HF_NAMES] + (["gate_proj", "up_proj", "down_proj"] if "m" in targets else [])
    return FinetuneSpec(mode="lora", lora_rank=R, lora_alpha=16, lora_targets=tuple(names), lora_dropout=dropout,
                        adapter_dtype="param")


def _estimate_by_block(kv: int, targets: str, dropout: float, framework: str = "litgpt") -> list[int]:
    items = activation_items(spec_from_hf_config(_cfg(kv)), StepSpec(batch=B, seq=S, precision="bf16"),
                             ImplSpec(device="cpu", framework=framework), _finetune(targets, dropout))
    return [sum(i.bytes for i in items if i.name.startswith(f"model.layers.{b}.")) for b in range(2)]


def test_lora_qv_block_exact_integers():
    """Block 1, GQA (Akv=2), LoRA on q and v, dropout 0.05, bf16 on CPU (the dropout mask in bf16)."""
    bsh2, bsh4 = B * S * H * 2, B * S * H * 4  # 16,384 and 32,768
    norm = bsh4 + B * S * 4 + H * 4  # x_fp32 + rsqrt + weight.float()
    # mask, dropout out, after_A, after_B (q + v), zero_pad's int64 index
    lora = 2 * bsh2 + B * S * 2 * R * 2 + B * S * (H + H // 2) * 2 + (H + H // 2) * 8
    attn = 4 * bsh2 + B * A * S * 4  # q_roped, k_repeat, v_repeat, SDPA out, fp32 lse
    mlp = 3 * B * S * F * 2
    assert _estimate_by_block(2, "qv", 0.05)[1] == 2 * norm + lora + attn + mlp == 292_864


def test_mha_keeps_the_fused_qkv_output():
    """With A = Akv, V reaches SDPA as a view of the fused qkv output: its 3·H-wide storage is kept."""
    gqa, mha = _estimate_by_block(2, "qv", 0.0)[1], _estimate_by_block(A, "qv", 0.0)[1]
    # GQA: k_repeat + v_repeat (2·BSH); MHA: k_roped (BSH) + the qkv output (3·BSH); after_B q+v: 1.5·H vs 2·H wide
    assert mha - gqa == B * S * (H + 3 * H - 2 * H) * 2 + (B * S * 2 + 8) * (2 * H - H - H // 2)


def test_lit_gpt_2023_norm_runs_in_the_input_dtype():
    """--framework lit-gpt (lit_gpt/rmsnorm.py at 8641822, before the fp32 upcast): each RMSNorm keeps x
    itself and a bf16 rsqrt, not x.float(), an fp32 rsqrt and weight.float(). (By hand against that
    commit's lit_gpt on CPU the whole stack of blocks matches to the byte: docs/litgpt.md.)"""
    new, old = _estimate_by_block(2, "qv", 0.05)[1], _estimate_by_block(2, "qv", 0.05, "lit-gpt")[1]
    assert new - old == 2 * ((B * S * H * 4 + B * S * 4 + H * 4) - (B * S * H * 2 + B * S * 2)) == 34_048


@pytest.mark.parametrize("bad", [dict(lora_targets=("all-linear",)), dict(adapter_dtype="float32")])
def test_refusals_name_the_field(bad):
    ft = FinetuneSpec(**{**dict(mode="lora", lora_targets=("q_proj",), adapter_dtype="param"), **bad})
    with pytest.raises(SpecError, match="lora_targets|adapter_dtype"):
        activation_items(spec_from_hf_config(_cfg(2)), StepSpec(batch=B, seq=S, precision="bf16"),
                         ImplSpec(device="cpu", framework="litgpt"), ft)
    with pytest.raises(SpecError, match="framework"):
        ImplSpec(profile="reference", framework="litgpt")
    with pytest.raises(UnsupportedError, match="litgpt"):
        activation_items(spec_from_hf_config(_cfg(2)), StepSpec(batch=B, seq=S, precision="bf16"),
                         ImplSpec(device="cpu", framework="litgpt", attention="eager"))


def _real_by_block(kv: int, targets: str, dropout: float) -> list[int]:
    torch = pytest.importorskip("torch")
    lora = pytest.importorskip("litgpt.lora")
    kw = dict(name="tiny", n_layer=2, n_embd=H, n_head=A, n_query_groups=kv, intermediate_size=F, block_size=64,
              mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False, parallel_residual=False,
              rotary_percentage=1.0, padded_vocab_size=V, vocab_size=V)
    if targets != "full":
        kw.update(lora_r=R, lora_alpha=16, lora_dropout=dropout, lora_query="q" in targets, lora_key="k" in targets,
                  lora_value="v" in targets, lora_projection="o" in targets, lora_mlp="m" in targets, lora_head=False)
    torch.manual_seed(0)
    model = lora.GPT(lora.Config(**kw)).to(torch.bfloat16)
    if targets != "full":
        lora.mark_only_lora_as_trainable(model)
    model.train()
    current, saved = [None], {}  # storage key -> (block, bytes), first saver's block

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if current[0] is not None and key not in saved:
            saved[key] = (current[0], t.untyped_storage().nbytes())
        return t

    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        block.register_forward_hook(lambda *_a: current.__setitem__(0, None))
    ids = torch.randint(0, V, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    states = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    totals = [sum(n for k, (b, n) in saved.items() if b == i and k not in states) for i in range(2)]
    del logits
    return totals


@pytest.mark.slow
@pytest.mark.parametrize("kv,targets,dropout", [(2, "qv", 0.05), (A, "qv", 0.05), (2, "qkvom", 0.0),
                                                (A, "qkm", 0.1), (2, "full", 0.0), (A, "full", 0.0)])
def test_blocks_match_real_litgpt_to_the_byte(kv, targets, dropout):
    assert _estimate_by_block(kv, targets, dropout) == _real_by_block(kv, targets, dropout)
