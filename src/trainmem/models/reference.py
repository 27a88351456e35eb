"""trainmem's reference decoder: a small GPT/Llama-style Transformer whose every knob is real.

Each field of :class:`~trainmem.specs.ModelSpec` and :class:`~trainmem.specs.ImplSpec` maps to
code here, so the ``reference`` estimate profile (``estimate/rules_reference.py``) can be checked
against what autograd actually keeps. Kept deliberately plain (nanoGPT spirit): one block class,
explicit ops, shape comments. Module paths are the estimate's item names::

    embed, pos_embed, layers.{i}.attn_norm, layers.{i}.attn.{q,k,v,o},
    layers.{i}.mlp_norm, layers.{i}.mlp.{gate,up,down}, norm, lm_head

Knobs and what they do here:

* ``norm`` / ``fused_norm``: ``F.rms_norm`` / ``F.layer_norm`` (native kernels) vs a python
  composite computed in fp32 (HF ``LlamaRMSNorm`` style).
* ``activation`` / ``fused_bias_act``: unfused is ``nn.Linear`` (bias inside addmm) followed by
  the activation op(s); fused is one autograd Function ``act(x + b) [* up]`` that keeps only
  its inputs and recomputes the activation in backward (Megatron's ``bias_gelu`` /
  ``bias_swiglu`` fusions).
* ``inplace_act``: ReLU and SiLU run in place (GELU has no in-place form; ignored there).
* dropout (``attn_dropout`` on the probabilities, ``hidden_dropout`` on each residual branch,
  ``embd_dropout`` on the embeddings) / ``fused_dropout``: a dropout Function that keeps its
  mask as bits packed 8 per byte (``uint8``, ⌈n/8⌉ bytes) instead of ``F.dropout``'s mask.
* ``attention``: ``eager`` (explicit softmax, fp32), ``sdpa`` (PyTorch picks), ``flash`` and
  ``sdpa-math`` (``sdpa_kernel`` pinned to that backend), ``mem-efficient`` (CUDA only: CPU has
  no such backend, so building it for ``device="cpu"`` raises). GQA: SDPA gets ``enable_gqa``;
  eager repeats K/V.
* ``recompute``: ``torch.utils.checkpoint`` (always non-reentrant) around the attention core
  (``selective``), every block (``full``) or every k-th block (``every-k``: ``ImplSpec.checkpointed``).

Known limitations: MoE, QK-norm and encoder models are not implemented (``UnsupportedError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec, ModelSpec

__all__ = ["build_reference_model", "check_supported", "ReferenceOutput"]


@dataclass
class ReferenceOutput:
    loss: Any  # scalar fp32 tensor, or None without labels
    logits: Any  # (B, S, V)


def build_reference_model(model: ModelSpec, impl: ImplSpec, *, dtype=None):
    """A freshly initialised reference decoder in training mode (``dtype``: parameter dtype)."""
    try:
        import torch  # noqa: F401
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise UnsupportedError("the reference model needs torch: pip install 'trainmem[torch]'") from None
    check_supported(model, impl)
    net = _build(model, impl)
    if dtype is not None:
        net = net.to(dtype)
    return net.train()


def check_supported(model: ModelSpec, impl: ImplSpec) -> None:
    """Raise :class:`UnsupportedError` for what the reference model does not implement
    (shared with the ``reference`` estimate profile, so both refuse the same inputs)."""
    if model.is_moe:
        raise UnsupportedError("reference model: MoE not implemented")
    if model.qk_norm:
        raise UnsupportedError("reference model: QK-norm not implemented")
    if model.arch != "decoder":
        raise UnsupportedError(f"reference model: arch={model.arch!r} not implemented (decoder only)")
    if impl.attention == "mem-efficient" and impl.device == "cpu":
        raise UnsupportedError("reference model: attention='mem-efficient' has no CPU kernel "
                               "(CPU SDPA has flash and math only)")
    if impl.attention == "flash" and impl.device == "cpu" and model.attn_dropout > 0:
        raise UnsupportedError("reference model: the CPU flash kernel has no dropout; "
                               "use attention='sdpa' or 'sdpa-math'")


def _build(m: ModelSpec, impl: ImplSpec):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class _PackedDropout(torch.autograd.Function):
        """Dropout keeping its mask as bits, 8 per byte."""

        @staticmethod
        def forward(fctx, x, p):
            keep = torch.rand_like(x, dtype=torch.float32) >= p  # bool, freed below
            fctx.p, fctx.numel = p, keep.numel()
            fctx.save_for_backward(_pack_bits(keep))  # (⌈n/8⌉,) uint8
            return x * keep / (1 - p)

        @staticmethod
        def backward(fctx, grad):
            keep = _unpack_bits(fctx.saved_tensors[0], fctx.numel).view(grad.shape)
            return grad * keep / (1 - fctx.p), None

    def _pack_bits(mask):
        flat = mask.reshape(-1)
        pad = (-flat.numel()) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
        return (flat.view(-1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)

    def _unpack_bits(packed, numel):
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        return ((packed[:, None] >> shifts) & 1).reshape(-1)[:numel].bool()

    def dropout(x, p, training):
        if p <= 0 or not training:
            return x
        if impl.fused_dropout:
            return _PackedDropout.apply(x, p)
        return F.dropout(x, p, training=True)

    def _act(x, kind):
        if kind in ("gelu", "geglu"):
            return F.gelu(x)
        if kind == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if kind == "relu":
            return F.relu(x)
        return F.silu(x)  # swiglu

    class _FusedBiasAct(torch.autograd.Function):
        """``act(x + b) [* up]`` keeping only x, b and up; the activation is recomputed."""

        @staticmethod
        def forward(fctx, x, b, up, kind):
            fctx.kind, fctx.has_b, fctx.has_up = kind, b is not None, up is not None
            fctx.save_for_backward(x, b, up)
            with torch.no_grad():
                y = _act(x if b is None else x + b, kind)
                return y if up is None else y * up

        @staticmethod
        def backward(fctx, grad):
            x, b, up = fctx.saved_tensors
            with torch.enable_grad():
                z = (x if b is None else x + b).detach().requires_grad_()
                a = _act(z, fctx.kind)
            (da,) = torch.autograd.grad(a, z, grad if up is None else grad * up)
            db = da.sum(tuple(range(da.dim() - 1))) if fctx.has_b else None
            dup = grad * a.detach() if fctx.has_up else None
            return da, db, dup, None

    class Norm(nn.Module):
        def __init__(self, H):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H))
            rms = m.norm == "rmsnorm"
            self.bias = nn.Parameter(torch.zeros(H)) if m.norm_bias and not rms else None
            self.eps = 1e-5

        def forward(self, x):  # (B, S, H)
            if m.norm == "rmsnorm":
                if impl.fused_norm:
                    return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
                x32 = x.float()
                rs = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, S, 1)
                return self.weight * (x32 * rs).to(x.dtype)
            if impl.fused_norm:
                return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
            x32 = x.float()
            xc = x32 - x32.mean(-1, keepdim=True)
            rs = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, S, 1)
            y = self.weight * (xc * rs).to(x.dtype)
            return y if self.bias is None else y + self.bias

    def rope(x, cos, sin):  # x (B, nh, S, hd); cos, sin (S, hd)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    backend = {"flash": "FLASH_ATTENTION", "sdpa-math": "MATH", "mem-efficient": "EFFICIENT_ATTENTION"}

    def attend(q, k, v, p):  # (B, A, S, hd), (B, Akv, S, hd) x2 -> (B, A, S, hd)
        A, Akv = m.num_heads, m.num_kv_heads
        if impl.attention == "eager":
            if Akv != A:
                k, v = k.repeat_interleave(A // Akv, dim=1), v.repeat_interleave(A // Akv, dim=1)
            S = q.shape[-2]
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, A, S, S)
            mask = torch.full((S, S), float("-inf"), dtype=att.dtype, device=att.device).triu(1)
            att = F.softmax(att + mask, dim=-1, dtype=torch.float32).to(v.dtype)
            return dropout(att, p, True) @ v
        kwargs = dict(is_causal=True, dropout_p=p, enable_gqa=Akv != A)
        if impl.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend[impl.attention])):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            H, hd = m.hidden_size, m.head_dim
            self.q = nn.Linear(H, m.num_heads * hd, bias=m.qkv_bias)
            self.k = nn.Linear(H, m.num_kv_heads * hd, bias=m.qkv_bias)
            self.v = nn.Linear(H, m.num_kv_heads * hd, bias=m.qkv_bias)
            self.o = nn.Linear(m.num_heads * hd, H, bias=m.out_bias)

        def forward(self, x, cos, sin):  # (B, S, H)
            B, S, _ = x.shape
            hd = m.head_dim
            q = self.q(x).view(B, S, m.num_heads, hd).transpose(1, 2)  # (B, A, S, hd)
            k = self.k(x).view(B, S, m.num_kv_heads, hd).transpose(1, 2)  # (B, Akv, S, hd)
            v = self.v(x).view(B, S, m.num_kv_heads, hd).transpose(1, 2)  # (B, Akv, S, hd)
            if cos is not None:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            p = m.attn_dropout if self.training else 0.0
            if impl.recompute == "selective":
                y = checkpoint(attend, q, k, v, p, use_reentrant=False)
            else:
                y = attend(q, k, v, p)
            return self.o(y.transpose(1, 2).reshape(B, S, m.num_heads * hd))  # (B, S, H)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            H, F_ = m.hidden_size, m.ffn_size
            self.gate = nn.Linear(H, F_, bias=m.mlp_bias) if m.gated else None
            self.up = nn.Linear(H, F_, bias=m.mlp_bias)
            self.down = nn.Linear(F_, H, bias=m.mlp_bias)

        def forward(self, x):  # (B, S, H)
            first = self.gate if m.gated else self.up
            if impl.fused_bias_act:
                u = F.linear(x, first.weight)  # (B, S, F), bias added inside the fused op
                up = self.up(x) if m.gated else None
                return self.down(_FusedBiasAct.apply(u, first.bias, up, m.activation))
            u = first(x)  # (B, S, F)
            if impl.inplace_act and m.activation in ("relu", "swiglu"):
                a = F.relu(u, inplace=True) if m.activation == "relu" else F.silu(u, inplace=True)
            else:
                a = _act(u, m.activation)
            if m.gated:
                a = a * self.up(x)
            return self.down(a)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.attn = Norm(m.hidden_size), Attention()
            self.mlp_norm, self.mlp = Norm(m.hidden_size), MLP()

        def forward(self, x, cos, sin):  # (B, S, H)
            a = dropout(self.attn(self.attn_norm(x), cos, sin), m.hidden_dropout, self.training)
            if m.parallel_residual:
                y = dropout(self.mlp(self.mlp_norm(x)), m.hidden_dropout, self.training)
                return x + a + y
            x = x + a
            return x + dropout(self.mlp(self.mlp_norm(x)), m.hidden_dropout, self.training)

    class Reference(nn.Module):
        def __init__(self):
            super().__init__()
            H, hd = m.hidden_size, m.head_dim
            self.embed = nn.Embedding(m.vocab_size, H)
            self.pos_embed = nn.Embedding(m.max_positions, H) if m.max_positions else None
            if not m.max_positions:  # rotary
                inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
                self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hd/2,)
            self.layers = nn.ModuleList(Block() for _ in range(m.num_layers))
            self.norm = Norm(H)
            self.lm_head = nn.Linear(H, m.vocab_size, bias=False)
            if m.tied_embeddings:
                self.lm_head.weight = self.embed.weight

        def forward(self, ids, labels=None):  # ids (B, S) int64
            B, S = ids.shape
            x = self.embed(ids)  # (B, S, H)
            cos = sin = None
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(S, device=ids.device))
            else:  # cos/sin are fresh per step, in the embedding dtype (as in HF)
                t = torch.arange(S, device=ids.device, dtype=torch.float32)
                freqs = torch.outer(t, self.inv_freq.float())  # (S, hd/2)
                emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd)
                cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            x = dropout(x, m.embd_dropout, self.training)
            for i, block in enumerate(self.layers):
                if impl.checkpointed(i):
                    x = checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            logits = self.lm_head(self.norm(x))  # (B, S, V)
            loss = None
            if labels is not None:  # shift labels, not logits (no logits copy); fp32 CE as in HF
                target = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)  # (B·S,)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target,
                                       ignore_index=-100)
            return ReferenceOutput(loss=loss, logits=logits)

    return Reference()
