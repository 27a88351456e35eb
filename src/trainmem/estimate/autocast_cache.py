"""Autocast's weight-cast cache: the low-precision weight copies held to the end of the forward.

Under ``torch.autocast`` a linear's weight is cast once per autocast region and kept in a cache
(``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: only for a leaf tensor that requires grad, and
only while caching is on), which ``torch.autocast.__exit__`` clears when the outermost region ends
(``torch/amp/autocast_mode.py``: ``torch.clear_autocast_cache()``). The HF Trainer and trainmem's trace
wrap the forward and the loss in autocast and run backward outside it, so every trainable weight's
copy lives until the loss is made. Without recompute the linears save those copies anyway (they are
activations); a checkpointed block saves none of them, but the cache still holds them through the
forward: the forward phase's ``autocast_weight_cache``.

Known limitations: fine-tuning (a frozen weight is not cached, an adapter's is) and the parallel
layouts (FSDP's unsharded weights, DTensor) are not modelled; compile keeps the casts inside its regions.
"""

from __future__ import annotations

from trainmem.inventory import Inventory

__all__ = ["autocast_cached_casts", "autocast_head_input"]

_CAST = ".weight_cast"  # the HF rules' name of a linear's autocast weight copy (estimate/ctx.py cast)


def autocast_cached_casts(saved: Inventory, recomputed: Inventory | None) -> int:
    """Bytes of the weight copies the cache holds that the saved set does not already count: those a
    recomputed (checkpointed) block made in its forward. 0 without recompute."""
    if recomputed is None:
        return 0
    def casts(inv: Inventory) -> int:
        return sum(i.bytes for i in inv if i.name.endswith(_CAST))
    return casts(recomputed) - casts(saved)


def autocast_head_input(saved: Inventory) -> int:
    """Under autocast the LM head reads a cast of the final norm's output (``lm_head.input_cast``); the
    output itself (the model output's ``last_hidden_state``, in the weights' dtype) is saved by no one but
    stays alive until the forward returns, after the loss (transformers ``LlamaForCausalLM.forward``:
    ``outputs`` is held while ``self.loss_function`` runs). Its bytes: 0 when the head keeps its input."""
    cast = next((i for i in saved if i.name == "lm_head.input_cast"), None)
    normed = next((i for i in saved if i.name == "model.norm.normed"), None)
    return normed.bytes if cast is not None and normed is not None else 0
