"""Architecture families: one module per family, registered with :func:`register_family`.

Adding a family is adding a module here (and importing it below): its config keys, parameter
layout, block rules, tensor-parallel roles, embedding and head names, classification heads and
default LoRA targets live in its :class:`Family`. See ``base.py`` for the registry and the
layer-kind hook, ``docs/families.md``.
"""

from __future__ import annotations

from trainmem.families.base import (PEFT_VERSION, BlockRules, ConfigSchema, Family, NameScheme, TaskHeads, TPRoles,
                                    default_attention, family_attentions,
                                    config_families, embedding_modules, families, family_names, get_family,
                                    get_scheme, head_modules, layer_containers, register_family, register_scheme,
                                    schemes, task_head_modules, token_embedding_modules, tp_roles,
                                    output_modules)

# registration order is the order of FAMILIES and of the supported model types in messages
from trainmem.families import gpt2, gpt_neox, llama, mistral, mixtral, qwen2, gemma, phi3, bert  # noqa: E402,F401
from trainmem.families import gemma3, deepseek, llama4, gpt_oss, qwen3_next, qwen3_moe, olmo2  # noqa: E402,F401
from trainmem.families import gpt_bigcode  # noqa: E402,F401
from trainmem.families import generic, profiles  # noqa: E402,F401

__all__ = ["Family", "ConfigSchema", "BlockRules", "TPRoles", "TaskHeads", "NameScheme", "PEFT_VERSION",
           "register_family", "register_scheme",
           "get_family", "get_scheme", "family_names", "families", "schemes", "config_families", "head_modules",
           "embedding_modules", "token_embedding_modules", "layer_containers", "tp_roles", "output_layers",
           "family_of", "task_head_modules", "output_modules", "default_attention",
           "family_attentions"]


def family_of(model) -> Family:
    """The family of a :class:`~trainmem.specs.model.ModelSpec`."""
    return get_family(model.family)


def output_layers() -> tuple[str, ...]:
    """Each family's output layer (``lm_head``, ``cls.predictions.decoder``): never adapted or quantized."""
    return tuple(dict.fromkeys(f.output_layer for f in families()))
