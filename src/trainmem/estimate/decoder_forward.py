"""GPT-2's forward moment inside its last block: the ``forward`` phase where it is larger than the end of the
forward (the loss). A classifier's logits are B·S·num_labels, not B·S·V, so with a classification head the loss
is no longer the forward's top; the last block's MLP residual add is.

**The last residual add** (``transformers/models/gpt2/modeling_gpt2.py`` ``GPT2Block.forward``:
``hidden_states = residual + feed_forward_hidden_states``): its output (the final LayerNorm's saved input, an
activation) is made beside every tensor the body saved so far and, unsaved (``add`` keeps no input:
derivatives.yaml ``add.Tensor``):

* ``GPT2Model.forward``'s ``inputs_embeds`` (B, S, H) and ``position_embeds`` (1, S, H: the position ids are
  ``cache_position.unsqueeze(0)``, broadcast in the sum), bound until the model returns: the embeddings' backward
  keeps the indices, and their sum is what the first block's dropout reads;
* the block's ``attn_output`` (the attention's ``resid_dropout`` output, in the ``c_proj`` output's dtype), bound in
  ``GPT2Block.forward`` until it returns;
* ``ln_2``'s output, bound as ``hidden_states`` until the add rebinds it, where ``c_fc`` does not save it (under
  autocast it saves a 16-bit cast; layer_norm runs in fp32, ``aten/src/ATen/autocast_mode.cpp``'s fp32 list);
* the MLP's output (``feed_forward_hidden_states``, its dropout's output; dropout keeps its mask).

Beside them the DynamicCache's unsaved K/V copies and autocast's cached bias copies of the blocks' linears
(``estimate/forward_held.py``); not yet the final norm's, the head's or the loss's tensors.

Where checked: ``tests/estimate/test_decoder_forward.py`` (a tiny GPT-2's seq-cls, token-cls and lm heads in
fp32, bf16 and amp-bf16, B1/B2 x S32/S64: the peak == a CPU fake-tensor trace's). Read for GPT-2 (``forward="gpt"``
without GPT-NeoX's block) under the hf profile on one device, eager, no recompute, no fine-tuning, no offload;
``phases`` unchanged otherwise.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.layer_stats import layer_stats
from trainmem.estimate.phase import Phase
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["with_decoder_forward", "residual_add_transients"]

#: the forward phase's parts made at or after the final norm (the loss's logits, the final norm's output, the LM
#: loss's padded labels) or recomputed here (the bias casts: the head's are not made yet)
_AFTER = ("logits", "head_input_unsaved", "padded_labels", "router_logits", "autocast_bias_cache")


def residual_add_transients(*, B: int, S: int, H: int, act: str, compute: str, norm_saved: bool) -> dict[str, int]:
    """Unsaved tensors alive when the last block's MLP residual add runs (the module docstring), in bytes. ``act``:
    the linears' output dtype; ``compute``: the embeddings' and LayerNorm's; ``norm_saved``: ``c_fc`` saves ``ln_2``'s
    output itself."""
    bsh = B * S * H
    return {"input_embeddings": (bsh + S * H) * dtype_bytes(compute),  # (B, S, H) tokens, (1, S, H) positions
            "attn_output": bsh * dtype_bytes(act),
            "ln_2_output": 0 if norm_saved else bsh * dtype_bytes(compute),
            "mlp_output": bsh * dtype_bytes(act)}


def modelled(model: ModelSpec, impl: ImplSpec, finetune=None) -> bool:
    rules = family_of(model).rules
    return (rules.forward == "gpt" and not rules.neox and model.arch == "decoder" and bool(model.max_positions)
            and impl.profile == "hf" and impl.framework == "hf" and not impl.compile and impl.recompute == "none"
            and finetune is None)


def _block_bias_cache(model: ModelSpec, step: StepSpec, impl: ImplSpec, items: Inventory) -> int:
    """Autocast's cached bias copies of the blocks' linears (the head's classifier is not run yet)."""
    from trainmem.estimate.forward_held import autocast_bias_cache, cast_linears
    from trainmem.names import layer_of
    blocks = {name for name in cast_linears(model, step, impl) if layer_of(name) is not None}
    return autocast_bias_cache(items, blocks, step.dtypes.activation)


def with_decoder_forward(phases: list[Phase], items: Inventory, model: ModelSpec, step: StepSpec, impl: ImplSpec,
                         finetune=None) -> list[Phase]:
    """``phases`` whose ``forward`` is the larger of the end of the forward and the last block's residual add (the
    module docstring). Idempotent: a ``forward`` already at the moment stays."""
    fwd = next((p for p in phases if p.name == "forward"), None)
    if fwd is None or not modelled(model, impl, finetune):
        return phases
    d = step.dtypes
    last = model.num_layers - 1
    st = layer_stats(items, ())
    parts = {k: v for k, v in fwd.parts.items() if k not in _AFTER}
    parts["activations"] = fwd.parts.get("activations", 0) - st.head_act
    norm_saved = any(i.name.endswith(".ln_2.out") and i.category is Category.ACTIVATION for i in block_items(items, last))
    parts.update(residual_add_transients(B=step.batch, S=step.seq, H=model.hidden_size,
                                         act=d.activation if d.autocast else d.compute, compute=d.compute,
                                         norm_saved=norm_saved))
    if d.autocast:
        parts["autocast_bias_cache"] = _block_bias_cache(model, step, impl, items)
    parts = {k: v for k, v in parts.items() if v}
    if sum(parts.values()) <= fwd.bytes:
        return phases
    note = ("at the last block's MLP residual add: every saved tensor of the body, the input embeddings, the "
            "block's attention and MLP outputs and ln_2's (estimate/decoder_forward.py)")
    return [Phase("forward", sum(parts.values()), parts, note) if p is fwd else p for p in phases]
