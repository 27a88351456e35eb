"""Build Hugging Face models from a config dict, never from the network and never remote code."""

from __future__ import annotations

from typing import Any, Mapping

from trainmem.errors import UnsupportedError

__all__ = ["build_hf_model", "HF_ATTENTION"]

#: trainmem attention name -> transformers ``attn_implementation``.
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "sdpa-math": "sdpa",
                "mem-efficient": "sdpa"}


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise UnsupportedError(
            f"this needs torch and transformers ({exc.name} is missing): pip install 'trainmem[torch]'"
        ) from None


def build_hf_model(config: Mapping[str, Any], *, attention: str = "sdpa", dtype=None):
    """Instantiate the model a ``config.json`` dict describes, with random weights.

    ``config`` must carry ``model_type``. Encoder models (``bert``) get a masked-LM head,
    everything else a causal-LM head. Nothing is downloaded and ``trust_remote_code`` is never set.
    """
    _require_torch()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' advisory lines would break one-line errors

    from trainmem.errors import ConfigError
    from trainmem.specs.loaders import spec_from_hf_config

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise UnsupportedError("config has no model_type")
    # the same validation as the estimator's: wrong types, unknown model types (auto_map is never
    # followed) and implausible sizes are SpecError/UnsupportedError here, not transformers errors
    spec_from_hf_config(config, name=str(config.get("_name_or_path") or model_type))
    for key in ("architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
        hf_config._attn_implementation = HF_ATTENTION.get(attention, attention)
        auto = AutoModelForMaskedLM if model_type == "bert" else AutoModelForCausalLM
        model = auto.from_config(hf_config, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # transformers' own config checks
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{model_type} config rejected by transformers: {first[:300]}") from None
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    return model
