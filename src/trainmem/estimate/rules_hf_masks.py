"""What a checkpointed ``hf`` block holds besides its hidden state: the position ids and, under
eager attention, the materialized (B, 1, S, S) causal mask, or the per-layer-type sliding-window
mask of models with both sliding and full blocks (Gemma-2/3, Qwen2/Qwen3; transformers'
``masking_utils.eager_mask``). Used by the model-level forwards of ``rules_hf`` and the families'
own rule modules.
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym


def _checkpoint_extras(ctx: Ctx, kernel: str, dtype: str, positions: Sym | None = None,
                       root: str = "model") -> list[Sym]:
    """Block inputs besides the hidden state that a checkpointed block holds: the position
    ids and, for eager attention, the materialized causal mask (B, 1, S, S)."""
    if ctx.impl.recompute == "none":
        return []
    g = ctx.graph
    held = []
    # selective checkpoints only the attention function, which still gets the position ids: the
    # decoder layer passes position_ids=... on and LlamaAttention.forward (modeling_llama.py) has no
    # such parameter, so they reach attention_interface in **kwargs, held by each checkpoint
    held.append(positions or g.new("model.position_ids", (1, ctx.S), ("1", "S"), "int64", False))
    if kernel == "eager":
        held.append(g.new(f"{root}.causal_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"), dtype, False))
    return held


def _eager_window_masks(ctx: Ctx, kernel: str, held: list[Sym], dtype: str) -> list[Sym]:
    """What a checkpointed sliding block holds under eager attention when the model has full blocks
    too: Gemma-2/3, Qwen2/Qwen3 build a mask per layer type (``modeling_gemma2.Gemma2Model.forward``:
    ``causal_mask_mapping`` of ``create_causal_mask`` and ``create_sliding_window_causal_mask``), and
    ``masking_utils.eager_mask`` materializes each, window reached or not (``allow_is_causal_skip=False``):
    a second (B, 1, S, S) additive mask in the activations' dtype, held by the sliding blocks'
    checkpoints instead of the causal one. (Mistral's one sliding mask is ``held``'s causal_mask.)"""
    kinds = {k.attention for k in ctx.model.kinds}
    if kernel != "eager" or not held or "sliding" not in kinds or kinds == {"sliding"}:
        return held
    sliding = ctx.graph.new("model.sliding_window_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"), dtype, False)
    return held[:-1] + [sliding]
