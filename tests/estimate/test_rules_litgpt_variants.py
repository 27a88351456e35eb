"""--framework litgpt's GPT-NeoX and Gemma blocks (estimate/rules_litgpt_variants.py), checked to the byte.

The slow test builds litgpt's real ``GPT`` from litgpt's own ``Config.from_name`` (StableLM-Alpha,
Gemma-2b, Gemma-2-9b) at tiny dims, runs it in bf16 on CPU under saved-tensor hooks and compares,
block by block, the storages autograd keeps (parameters and buffers apart, one storage counted once:
in the block that made it, else in the first block that keeps it) with the estimate's items of that
block. litgpt is optional (``pip install --no-deps litgpt==0.5.13`` plus ``lightning``): skipped
without it.
"""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

H, A, V, B, S, R, HD = 128, 4, 512, 2, 32, 8, 32
#: litgpt config name -> (its tiny overrides, the same model as an HF config, its HF root)
MODELS = {
    "stablelm-base-alpha-3b": (dict(n_embd=H, n_head=A), dict(
        model_type="gpt_neox", hidden_size=H, intermediate_size=4 * H, num_attention_heads=A, rotary_pct=0.25,
        use_parallel_residual=True, hidden_act="gelu", max_position_embeddings=64), "gpt_neox.layers"),
    "Gemma-2b": (dict(n_embd=H, n_head=A, n_query_groups=1, intermediate_size=2 * H), dict(
        model_type="gemma", hidden_size=H, intermediate_size=2 * H, num_attention_heads=A, num_key_value_heads=1,
        head_dim=HD, hidden_activation="gelu_pytorch_tanh"), "model.layers"),
    "Gemma-2-9b": (dict(n_embd=H, n_head=A, n_query_groups=2, head_size=HD, intermediate_size=2 * H), dict(
        model_type="gemma2", hidden_size=H, intermediate_size=2 * H, num_attention_heads=A, num_key_value_heads=2,
        head_dim=HD, hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=256, sliding_window=4096), "model.layers"),
}
# GPT-NeoX without parallel residual: norm_2 reads x + attention's output
MODELS["stablelm-base-alpha-3b/seq"] = (dict(MODELS["stablelm-base-alpha-3b"][0], parallel_residual=False),
                                        dict(MODELS["stablelm-base-alpha-3b"][1], use_parallel_residual=False),
                                        "gpt_neox.layers")
# MHA under soft-capping: V, a view of the fused qkv, reaches the eager matmul as a fresh copy
MODELS["Gemma-2-9b/mha"] = (dict(MODELS["Gemma-2-9b"][0], n_query_groups=A),
                            dict(MODELS["Gemma-2-9b"][1], num_key_value_heads=A), "model.layers")
#: LitGPT's LoRA flags -> trainmem's targets per family (GPT-NeoX: the fused module and its slices)
FLAGS = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}


def _targets(name: str, flags: str) -> tuple[str, ...]:
    neox = name.startswith("stablelm")
    out = [FLAGS[f] for f in flags if f in FLAGS]
    out += (["query_key_value"] if neox and out else []) + (["o_proj" if not neox else "dense"] if "o" in flags else [])
    mlp = ["dense_h_to_4h", "dense_4h_to_h"] if neox else ["gate_proj", "up_proj", "down_proj"]
    out += mlp if "m" in flags else []
    return tuple(out)


def _estimate_by_block(name: str, flags: str, dropout: float) -> list[int]:
    root = MODELS[name][2]
    ft = None if flags == "full" else FinetuneSpec(mode="lora", lora_rank=R, lora_alpha=16, adapter_dtype="param",
                                                   lora_targets=_targets(name, flags), lora_dropout=dropout)
    return [sum(i.bytes for i in _items(name, ft) if i.name.startswith(f"{root}.{b}.")) for b in range(2)]


def _items(name: str, ft: FinetuneSpec | None, framework: str = "litgpt"):
    """Gemma-2 asks for --attention eager (transformers has no SDPA for it; LitGPT soft-caps eagerly)."""
    cfg = spec_from_hf_config(dict(MODELS[name][1], num_hidden_layers=2, vocab_size=V))
    impl = ImplSpec(device="cpu", framework=framework, attention="eager" if name.startswith("Gemma-2-") else "sdpa")
    return activation_items(cfg, StepSpec(batch=B, seq=S, precision="bf16"), impl, ft)


def test_neox_block_exact_integers():
    """StableLM-Alpha's block 1 under LitGPT, LoRA on the q and v slices (dropout 0.05, its CPU mask in bf16)."""
    bsh2 = B * S * H * 2  # 16,384
    norms = B * S * H * 2 + 2 * 2 * B * S * 2  # the block input (kept by both LayerNorms) + two bf16 mean/rstd pairs
    lora = 2 * bsh2 + B * S * 2 * R * 2 + B * S * 2 * H * 2 + 2 * H * 8  # mask, dropout out, after_A, after_B, index
    attn = 3 * bsh2 + 2 * bsh2 + bsh2 + B * A * S * 4  # qkv (V's view), q and k cats, SDPA out, lse (frozen proj)
    mlp = B * S * 4 * H * 2  # fc's output, GELU's input (proj is frozen: GELU's output is not kept)
    assert _estimate_by_block("stablelm-base-alpha-3b", "qv", 0.05)[1] == norms + lora + attn + mlp == 251_392


def test_gemma2_softcap_keeps_the_eager_scores():
    """Gemma-2 under LitGPT: soft-capping takes the eager path, which keeps tanh's bf16 output, the fp32
    softmax and its bf16 cast, (B, A, S, S) each, and no SDPA log-sum-exp; then two post-norms (fp32 input and
    normalized tensor, rsqrt, (1 + w).float()) over the block's H-wide outputs."""
    items = {i.name: i.bytes for i in _items("Gemma-2-9b", None)}
    core = [items[f"model.layers.1.self_attn.{n}"] for n in ("softcap_tanh", "softmax", "probs")]
    assert core == [B * A * S * S * 2, B * A * S * S * 4, B * A * S * S * 2] == [16_384, 32_768, 16_384]
    assert not any(n.endswith(".lse") for n in items)
    post = [sum(b for n, b in items.items() if n.startswith(f"model.layers.1.{p}.")) for p in
            ("post_attention_layernorm", "post_feedforward_layernorm")]
    # the weight trains (full fine-tune): the fp32 normalized tensor too
    assert post == [2 * B * S * H * 4 + B * S * 4 + H * 4] * 2 == [66_304] * 2


@pytest.mark.parametrize("targets", [("query_key_value",), ("query_key_value", "q_proj"), ("q_proj", "v_proj")])
def test_neox_lora_needs_the_module_and_two_slices(targets):
    with pytest.raises((SpecError, UnsupportedError), match="lora_targets"):
        _items("stablelm-base-alpha-3b", FinetuneSpec(mode="lora", lora_targets=targets, adapter_dtype="param"))


def test_gemma_is_refused_under_2023_lit_gpt():
    with pytest.raises(UnsupportedError, match="lit-gpt"):
        _items("Gemma-2b", None, "lit-gpt")


def _saved_by_block(model, ids) -> list[int]:
    """Run ``model(ids)`` under saved-tensor hooks: bytes of the storages kept per block. Like the
    estimate's names, a block's output is the block's that made it, whoever keeps it (the next block's
    LayerNorm, ``ln_f``), and the embedding output is no block's; anything else is the first keeper's."""
    import torch
    block_of, first, made_by = [None], {}, {}

    def pack(t):
        first.setdefault(t.untyped_storage().data_ptr(), (block_of[0], t.untyped_storage().nbytes()))
        return t

    def enter(i, x):  # the tensor is held, so that its address is not reused by a later one
        made_by[x.untyped_storage().data_ptr()] = (i - 1 if i else None, x)
        block_of[0] = i

    def leave(i, out):
        made_by[out.untyped_storage().data_ptr()] = (i, out)
        block_of[0] = None

    for i, blk in enumerate(model.transformer.h):
        blk.register_forward_pre_hook(lambda _m, args, i=i: enter(i, args[0]))
        blk.register_forward_hook(lambda _m, _a, out, i=i: leave(i, out))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
    states = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    per_block = [0] * len(model.transformer.h)
    for ptr, (blk, nbytes) in first.items():
        blk = made_by.get(ptr, (blk,))[0]
        if blk is not None and ptr not in states:
            per_block[blk] += nbytes
    del out, made_by
    return per_block


def _real_by_block(name: str, flags: str, dropout: float) -> list[int]:
    torch = pytest.importorskip("torch")
    lora = pytest.importorskip("litgpt.lora")
    tiny, _, _ = MODELS[name]
    kw = dict(tiny, n_layer=2, block_size=64, padded_vocab_size=V, vocab_size=V)
    if flags != "full":
        kw.update(lora_r=R, lora_alpha=16, lora_dropout=dropout, lora_query="q" in flags, lora_key="k" in flags,
                  lora_value="v" in flags, lora_projection="o" in flags, lora_mlp="m" in flags, lora_head=False)
    torch.manual_seed(0)
    model = lora.GPT(lora.Config.from_name(name.split("/")[0], **kw)).to(torch.bfloat16)
    if flags != "full":
        lora.mark_only_lora_as_trainable(model)
    model.train()
    return _saved_by_block(model, torch.randint(0, V, (B, S)))


@pytest.mark.slow
@pytest.mark.parametrize("name,flags,dropout", [
    ("stablelm-base-alpha-3b", "qv", 0.05), ("stablelm-base-alpha-3b", "kvom", 0.0),
    ("stablelm-base-alpha-3b", "full", 0.0), ("Gemma-2b", "qv", 0.05), ("Gemma-2b", "qkvom", 0.1),
    ("Gemma-2b", "full", 0.0), ("Gemma-2-9b", "qkvom", 0.1), ("Gemma-2-9b", "full", 0.0),
    ("Gemma-2-9b/mha", "qv", 0.0), ("stablelm-base-alpha-3b/seq", "qvm", 0.0)])
def test_variant_blocks_match_real_litgpt_to_the_byte(name, flags, dropout):
    assert _estimate_by_block(name, flags, dropout) == _real_by_block(name, flags, dropout)
