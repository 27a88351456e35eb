"""The pre-norm residual block's skeleton, shared by the hand-written block rules.

transformers' ``LlamaDecoderLayer.forward`` (``models/llama/modeling_llama.py``), DeepSeek-V2/V3's
decoder layer (``models/deepseek_v3/modeling_deepseek_v3.py``) and LitGPT's ``Block.forward``
(``litgpt/model.py``, non-parallel residual) all run::

    x = x + self_attn(input_layernorm(x))
    x = x + mlp(post_attention_layernorm(x))

The rules differ in the norm, the attention and the MLP; :func:`prenorm_block` takes those as
callables and keeps the order in which the tensors are made (the estimate's allocation order and
names depend on it). Gemma-2/3's sandwich norms and OLMo-2's post-norms add a norm on each
branch's output before its residual add (``out_norm``).
"""

from __future__ import annotations

from typing import Callable

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym

__all__ = ["prenorm_block"]

#: ``norm(x, name)``: the norm module ``name`` applied to ``x``
Norm = Callable[[Sym, str], Sym]


def prenorm_block(ctx: Ctx, x: Sym, norm: Norm, attention: Callable[[Sym], Sym], mlp: Callable[[Sym], Sym], *,
                  mlp_norm: str = "post_attention_layernorm", out_norm: Norm | None = None) -> Sym:
    """norm -> ``self_attn`` -> residual add -> norm -> ``mlp`` -> residual add. ``attention`` and
    ``mlp`` run inside their modules; ``mlp_norm`` names the second norm (Gemma's
    ``pre_feedforward_layernorm``); ``out_norm`` normalizes each branch's output
    (``post_attention_layernorm``, ``post_feedforward_layernorm``) before it is added."""
    g = ctx.graph
    h = norm(x, "input_layernorm")
    with g.module("self_attn"):
        a = attention(h)
    if out_norm is not None:
        a = out_norm(a, "post_attention_layernorm")
    x = ctx.add(x, a, "residual_attn")
    h = norm(x, mlp_norm)
    with g.module("mlp"):
        y = mlp(h)
    if out_norm is not None:
        y = out_norm(y, "post_feedforward_layernorm")
    return ctx.add(x, y, "residual_mlp")
