"""Build Hugging Face models from a config dict, never from the network and never remote code.

Any ``model_type`` that the installed transformers can build from a config is accepted, with one
of five heads (:data:`HEADS`). The model class comes from transformers' own Auto mappings
(``transformers/models/auto/modeling_auto.py``); ``auto_map`` is never followed.

Known limitations:
  - Model types only the estimator knows are validated by the estimator's reader too; other types
    get a generic check of their size keys, then transformers' own config checks.
"""

from __future__ import annotations

from typing import Any, Mapping

from trainmem.errors import ConfigError, SpecError, UnsupportedError

__all__ = ["build_hf_model", "choose_head", "HF_ATTENTION", "HEADS", "tp_plan_of"]

#: trainmem attention name -> transformers ``attn_implementation``.
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "sdpa-math": "sdpa",
                "mem-efficient": "sdpa"}

#: head name -> (transformers Auto class, the architectures suffix that names it).
HEADS = {
    "lm": ("AutoModelForCausalLM", "ForCausalLM"),
    "mlm": ("AutoModelForMaskedLM", "ForMaskedLM"),
    "seq-cls": ("AutoModelForSequenceClassification", "ForSequenceClassification"),
    "token-cls": ("AutoModelForTokenClassification", "ForTokenClassification"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "ForConditionalGeneration"),
}
#: head name -> the Auto mapping (``modeling_auto``) that lists the model types it can build.
_MAPPINGS = {"lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "mlm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
             "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"}

# size keys checked for model types the estimator does not read (it checks its own)
_SIZE_KEYS = ("hidden_size", "d_model", "n_embd", "intermediate_size", "d_ff", "num_hidden_layers", "num_layers",
              "n_layer", "num_attention_heads", "num_heads", "n_head", "vocab_size", "num_local_experts",
              "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_MAX_SIZE = 10**7
_MAX_LAYERS = 10_000


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise UnsupportedError(
            f"this needs torch and transformers ({exc.name} is missing): pip install 'trainmem[torch]'"
        ) from None


def _supports(head: str, model_type: str) -> bool:
    from transformers.models.auto import modeling_auto
    return model_type in getattr(modeling_auto, _MAPPINGS[head])


def choose_head(config: Mapping[str, Any], head: str | None = None) -> str:
    """The head to build: ``head`` when given, else the one ``architectures`` names, else the
    model type's natural one (encoder-decoder -> seq2seq, encoder -> mlm, decoder -> lm)."""
    _require_torch()
    model_type = config.get("model_type")
    if head is None:
        archs = config.get("architectures") or []
        for name, (_, suffix) in HEADS.items():
            if archs and isinstance(archs[0], str) and archs[0].endswith(suffix) and _supports(name, model_type):
                head = name
                break
    if head is None:
        if config.get("is_encoder_decoder") or (_supports("seq2seq", model_type) and not _supports("lm", model_type)):
            head = "seq2seq"
        elif _supports("mlm", model_type) and not config.get("is_decoder"):
            head = "mlm"
        else:
            head = "lm"
    if head not in HEADS:
        raise SpecError("head", head, f"must be one of {', '.join(HEADS)}")
    if not _supports(head, model_type):
        can = [h for h in HEADS if _supports(h, model_type)]
        raise UnsupportedError(f"model_type={model_type!r} has no {head} head in transformers "
                               f"(it has: {', '.join(can) or 'none of ' + ', '.join(HEADS)})")
    return head


def _validate(config: Mapping[str, Any], model_type: str) -> None:
    """Refuse what transformers would not build or would build wrong, before it runs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, spec_from_hf_config

    if model_type in SUPPORTED_MODEL_TYPES:
        # the estimator's checks: wrong types, implausible sizes, options it refuses
        spec_from_hf_config(config, name=str(config.get("_name_or_path") or model_type))
        return
    if model_type not in CONFIG_MAPPING_NAMES:
        remote = " (it has auto_map, but trainmem never runs remote code)" if "auto_map" in config else ""
        raise UnsupportedError(f"model_type={model_type!r} is not a model type transformers can build{remote}")
    for key in _SIZE_KEYS:
        if key in config and config[key] is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(key, value, "must be a positive integer")
            limit = _MAX_LAYERS if "layer" in key else _MAX_SIZE
            if value > limit:
                raise SpecError(key, value, f"is implausibly large (max {limit})")


def build_hf_model(config: Mapping[str, Any], *, attention: str = "sdpa", head: str | None = None,
                   experts: str | None = None, init_weights: bool = True, dtype=None):
    """Instantiate the model a ``config.json`` dict describes, with random weights.

    ``config`` must carry ``model_type``; ``head`` is one of :data:`HEADS` (default:
    :func:`choose_head`). ``experts`` sets transformers' ``experts_implementation`` for MoE models
    (``grouped_mm``, ``eager``, ...). ``init_weights=False`` skips weight initialization (on fake
    tensors it must: ModernBERT's ``trunc_normal_`` is a rejection loop that reads data). ``dtype``
    builds the model in that dtype as ``from_pretrained(dtype=...)`` loads it: constructed under it as
    the default dtype (``modeling_utils.PreTrainedModel._from_config`` and ``get_init_context``:
    ``local_torch_dtype``), so buffers made with an explicit dtype stay in it (RoPE's fp32
    ``inv_freq``, which a ``model.to(dtype)`` would cast), then ``_keep_in_fp32_modules_strict``
    kept fp32 (:func:`_keep_strict_fp32`). Nothing is downloaded and ``trust_remote_code`` is never set.
    """
    _require_torch()
    import transformers
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' advisory lines would break one-line errors

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise UnsupportedError("config has no model_type")
    _validate(config, model_type)
    head = choose_head(config, head)
    for key in ("architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
        hf_config._attn_implementation = HF_ATTENTION.get(attention, attention)
        if head == "seq-cls" and getattr(hf_config, "pad_token_id", None) is None:
            # decoder classifiers pool the last non-pad token and refuse B > 1 without a pad id
            hf_config.pad_token_id = 0
        auto = getattr(transformers, HEADS[head][0])
        kwargs = {"experts_implementation": experts} if experts else {}
        if dtype is not None:
            kwargs["dtype"] = dtype
        if init_weights:
            model = auto.from_config(hf_config, trust_remote_code=False, **kwargs)
        else:
            from transformers.initialization import no_init_weights
            with no_init_weights():  # it skips init_weights, which also ties the embeddings
                model = auto.from_config(hf_config, trust_remote_code=False, **kwargs)
            model.tie_weights(recompute_mapping=False)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, AssertionError) as exc:  # transformers' own config checks
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "does not support an attention implementation" in first:
            raise UnsupportedError(f"{model_type} has no {attention} attention in transformers; "
                                   "trace it with --attention eager") from None
        raise ConfigError(f"{model_type} config rejected by transformers: {first[:300]}") from None
    if dtype is not None:
        _keep_strict_fp32(model, dtype)
    model.train()
    return model


def _keep_strict_fp32(model, dtype) -> None:
    """In fp16/bf16 the parameters and buffers a model's ``_keep_in_fp32_modules_strict`` names stay
    fp32, as ``from_pretrained(dtype=...)`` loads them (``modeling_utils.PreTrainedModel._get_dtype_plan``,
    matched as ``core_model_loading`` matches them): DeepSeek's router ``gate.weight`` and
    ``e_score_correction_bias``, so its ``weight.type(torch.float32)`` makes no copy."""
    import torch
    from transformers.core_model_loading import build_glob_alternation

    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    if not strict or dtype not in (torch.float16, torch.bfloat16):
        return
    pattern = build_glob_alternation(list(strict))[0]
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if pattern.search(name):
                t.data = t.data.float()


def tp_plan_of(model) -> dict[str, str]:
    """transformers' ``base_model_tp_plan`` (module pattern -> colwise/rowwise/...), prefixed as
    the model names its modules; empty when the model has none."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    base = getattr(model, "base_model_prefix", "")
    prefix = f"{base}." if base and hasattr(model, base) else ""
    return {f"{prefix}{k}": str(v) for k, v in plan.items()}
