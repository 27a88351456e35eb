"""MLA (DeepSeek-V2/V3) on CUDA (issue 14): the kernel PyTorch's SDPA dispatcher picks for q/k heads of
hd = nope + rope and v heads of vd dims (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash
needs equal head dims, memory-efficient takes them unequal) and transformers' FlashAttention-2 path (v
padded to hd, the output sliced back). No GPU is lent here: the selection follows the source, and the saved
set of the memory-efficient op is checked on the meta device (its autograd node and meta kernel are real)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

B, S, A = 2, 40, 4  # S = 40: the memory-efficient kernel pads its log-sum-exp to 64 queries
NOPE, ROPE, VD = 16, 8, 16
HD = NOPE + ROPE
_V3 = dict(model_type="deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None,
           n_shared_experts=1, n_group=1, topk_group=1, hidden_size=128, num_attention_heads=A,
           num_key_value_heads=A, vocab_size=500, intermediate_size=256, moe_intermediate_size=32,
           n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, qk_nope_head_dim=NOPE,
           qk_rope_head_dim=ROPE, v_head_dim=VD)
_BYTES = {"bfloat16": 2, "float32": 4}


def _core(config: dict, precision: str, attention: str, layer: int = 1) -> dict[str, tuple]:
    """The attention core's items of one block (not the projections' own, but kv_b_proj's output, which
    the strided v pins): name -> (shape, dtype)."""
    items = activation_items(spec_from_hf_config(config), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention=attention, device="cuda"))
    pre = f"model.layers.{layer}.self_attn."
    names = {i.name[len(pre):]: (i.shape, i.dtype) for i in items if i.name.startswith(pre)}
    return {n: v for n, v in names.items() if "layernorm" not in n and ("_proj" not in n or n == "kv_b_proj.out")}


@pytest.mark.parametrize("precision, dt", [("bf16", "bfloat16"), ("amp-bf16", "bfloat16"), ("fp32", "float32")])
def test_sdpa_runs_memory_efficient_with_unequal_head_dims(precision, dt):
    # flash refuses hd=24 != vd=16 (check_head_dim_size_flash); memory-efficient keeps q, k, v as passed
    # (v: the strided split of kv_b_proj's output, so all of it), the output and the padded fp32 lse
    assert _core(_V3, precision, "sdpa") == {
        "query_states": ((B, A, S, HD), dt), "key_states": ((B, A, S, HD), dt),
        "kv_b_proj.out": ((B, S, A * (NOPE + VD)), dt),
        "sdpa_out": ((B, S, A * VD), dt), "lse": ((B, A, 64), "float32")}
    assert _core(_V3, precision, "mem-efficient") == _core(_V3, precision, "sdpa")


def test_flash_pads_v_and_copies_the_sliced_output():
    # transformers' flash_attention_forward: F.pad(value) -> (B, S, A, hd), the kernel's hd-wide output,
    # attn_output[..., :vd].reshape(B, S, -1) -> a (B, S, A·vd) copy that o_proj keeps; kv_b_proj's output
    # is no longer held (the padded v is a fresh tensor)
    assert _core(_V3, "bf16", "flash") == {
        "query_states": ((B, A, S, HD), "bfloat16"), "key_states": ((B, A, S, HD), "bfloat16"),
        "v_padded": ((B, A, S, HD), "bfloat16"), "sdpa_out": ((B, S, A * HD), "bfloat16"),
        "lse": ((B, A, S), "float32"), "attn_out": ((B, S, A * VD), "bfloat16")}


def test_efficient_items_equal_the_real_ops_saved_set_on_meta():
    """aten._scaled_dot_product_efficient_attention on meta tensors shaped as the MLA block's: what its
    autograd node keeps equals the estimate's items, storage by storage (v is a view of kv_b_proj's output).
    The two 0-dim int64 philox seed/offset tensors are left out: without dropout the CUDA kernel makes them
    on the host (attention.cu ``_efficient_attention_forward``), and the Llama rules leave them out too."""
    kv = torch.empty(B, S, A * (NOPE + VD), device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = kv.view(B, S, A, NOPE + VD).transpose(1, 2)[..., NOPE:]
    q, k = (torch.empty(B, A, S, HD, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    saved = []

    def pack(t):
        if t.dim():
            base = t._base if t._base is not None else t
            saved.append((tuple(base.shape), str(base.dtype).removeprefix("torch.")))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
    assert out.transpose(1, 2).is_contiguous()  # (B, A, S, vd) laid out as (B, S, A·vd): no copy after it
    core = _core(_V3, "bf16", "sdpa")
    # the estimate's output item is (B, S, A·vd), the op's (B, A, S, vd) view of it: compare element counts
    flat = sorted((torch.Size(s).numel(), d) for s, d in saved)
    assert flat == sorted((torch.Size(s).numel(), d) for s, d in core.values())


def test_efficient_items_reduce_to_llamas_when_head_dims_are_equal():
    # vd = hd: the kernel's own items (output, lse) and q/k equal the Llama rules' for the same heads
    mla = _core({**_V3, "v_head_dim": HD}, "bf16", "mem-efficient")
    llama = dict(model_type="llama", hidden_size=A * HD, num_attention_heads=A, num_key_value_heads=A, head_dim=HD,
                 intermediate_size=64, num_hidden_layers=2, vocab_size=500)
    ref = _core(llama, "bf16", "mem-efficient")
    assert mla["sdpa_out"] == ref["sdpa_out"] == ((B, S, A * HD), "bfloat16")
    assert mla["lse"] == ref["lse"] == ((B, A, 64), "float32")
    numel = {n: (torch.Size(s).numel(), d) for n, (s, d) in {**mla, **ref}.items()}  # Llama's are (B, S, A·hd)
    assert numel["query_states"] == numel["key_states"] == numel["q_rope"] == numel["k_cache"] == numel["v_cache"]


def test_refusals_on_cuda_are_one_line():
    unaligned = {**_V3, "qk_nope_head_dim": 12, "qk_rope_head_dim": 12}  # hd 24, but v starts at column 12
    for config, precision, attention, needle in ((unaligned, "bf16", "sdpa", "multiples of 8"),
                                                 (_V3, "fp32", "flash", "16-bit"),
                                                 (_V3, "bf16", "sdpa-math", "not modelled")):
        with pytest.raises(UnsupportedError, match=needle) as exc:
            _core(config, precision, attention)
        assert "\n" not in str(exc.value)


# a real model's forward on the shared CPUs: slow. Selective recompute (the attention function checkpointed,
# holding q, k, the kv_b_proj output its v views, and the position ids) and every-k are modelled for every
# kernel; CPU runs the math kernel, which is what autograd can check here
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("recompute", ["selective", "every-k"])  # every-k: blocks 0, 2, ... (k = 2)
def test_recompute_equals_autograd_on_cpu(attention, precision, recompute):
    from kinds_configs import check_against_autograd

    check_against_autograd({**_V3, "num_hidden_layers": 3}, precision, attention, recompute)
