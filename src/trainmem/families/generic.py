"""``generic``: a spec written by hand (or read from Megatron/torchtitan arguments), with Llama
module names; the only family that models either architecture (decoder or encoder)."""

from __future__ import annotations

from trainmem.families.base import Family, register_family
from trainmem.families.bert import BERT_TASK_HEADS
from trainmem.families.buffers import generic_buffers
from trainmem.families.llama import llama_family


@register_family
def generic() -> Family:
    # an encoder spec takes BERT's classification heads; LoRA targets Llama's q_proj, v_proj
    return llama_family("generic", None, encoder=True, encoder_task_heads=BERT_TASK_HEADS,
                        buffers=generic_buffers)
