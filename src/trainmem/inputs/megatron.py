"""A Megatron-LM argument list (what a ``pretrain_gpt.py`` launch script passes) -> overrides.

Architecture flags become ModelSpec fields (family ``generic``: Llama-style module names), the
batch and precision flags StepSpec fields, attention and recompute flags ImplSpec fields, and the
parallel sizes ParallelSpec fields. Megatron's own defaults apply where a flag is absent and it
matters: biases on every linear (unless ``--disable-bias-linear``), tied embeddings (unless
``--untie-embeddings-and-output-weights``), dropout 0.1, LayerNorm, GELU, learned positions.

Flags that do not change memory (learning rate, data paths, logging, ...) are ignored and listed
under ``raw["ignored"]``. The profile is left as given: ``--profile megatron`` selects the paper's
accounting (Korthikanti et al. 2022), the default models the saved set of the named kernels.
"""

from __future__ import annotations

import shlex
from typing import Any

from trainmem.errors import ConfigError

from trainmem.inputs._common import answer

__all__ = ["parse_megatron_args"]

MAX_ARGS_CHARS = 1 << 16

_INT = {  # flag -> (section, field); None: read, checked and shown, not mapped directly
    "--num-layers": ("model", "num_layers"),
    "--hidden-size": ("model", "hidden_size"),
    "--num-attention-heads": ("model", "num_heads"),
    "--ffn-hidden-size": ("model", "ffn_size"),
    "--kv-channels": ("model", "head_dim"),
    "--num-query-groups": None,
    "--vocab-size": ("model", "vocab_size"),
    "--padded-vocab-size": ("model", "vocab_size"),
    "--max-position-embeddings": None,
    "--num-experts": ("model", "num_experts"),
    "--moe-router-topk": ("model", "top_k"),
    "--moe-ffn-hidden-size": ("model", "expert_ffn_size"),
    "--micro-batch-size": ("step", "batch"),
    "--seq-length": ("step", "seq"),
    "--global-batch-size": None,
    "--tensor-model-parallel-size": ("parallel", "tp"),
    "--pipeline-model-parallel-size": ("parallel", "pp"),
    "--context-parallel-size": ("parallel", "cp"),
    "--expert-model-parallel-size": ("parallel", "ep"),
    "--num-layers-per-virtual-pipeline-stage": None,
    "--recompute-num-layers": None,
    "--data-parallel-size": ("parallel", "dp"),
}
_FLOAT = ("--attention-dropout", "--hidden-dropout")
_CHOICE = {
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--position-embedding-type": ("learned_absolute", "rope", "none"),
    "--optimizer": ("adam", "sgd"),
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
}
_BOOL = (
    "--sequence-parallel", "--bf16", "--fp16", "--use-flash-attn", "--swiglu", "--disable-bias-linear",
    "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--group-query-attention",
    "--use-distributed-optimizer", "--recompute-activations", "--qk-layernorm",
)


def parse_megatron_args(text: str) -> dict:
    """Overrides from a Megatron-LM argument string such as
    ``"--num-layers 32 --hidden-size 4096 --micro-batch-size 1 --seq-length 4096 --bf16"``."""
    if not isinstance(text, str):
        raise ConfigError(f"megatron-args: expected a string, got {type(text).__name__}")
    if len(text) > MAX_ARGS_CHARS:
        raise ConfigError(f"megatron-args: {len(text)} characters, more than {MAX_ARGS_CHARS}")
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as exc:
        raise ConfigError(f"megatron-args: cannot split the argument string ({exc})") from None
    raw, ignored = _scan(tokens)
    out = _map(raw)
    out["raw"]["ignored"] = ignored
    return out


def _scan(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    raw: dict[str, Any] = {}
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            ignored.append(tok)
            continue
        flag, eq, value = tok.partition("=")
        known = flag in _INT or flag in _FLOAT or flag in _CHOICE
        if flag in _BOOL:
            if eq:
                raise ConfigError(f"megatron-args: {flag} takes no value, got {tok!r}")
            raw[flag] = True
            continue
        if not eq:
            if i < len(tokens) and not tokens[i].startswith("--"):
                value = tokens[i]
                i += 1
            elif known:
                raise ConfigError(f"megatron-args: {flag} needs a value")
            else:
                ignored.append(flag)
                continue
        if not known:
            ignored.append(flag)
            continue
        raw[flag] = _convert(flag, value)
    return raw, ignored


def _convert(flag: str, value: str) -> Any:
    if flag in _INT:
        try:
            n = int(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"megatron-args: {flag}={value!r} must be an integer") from None
        if n <= 0:
            raise ConfigError(f"megatron-args: {flag}={n} must be positive")
        return n
    if flag in _FLOAT:
        try:
            x = float(value)
        except ValueError:
            raise ConfigError(f"megatron-args: {flag}={value!r} must be a number") from None
        if not 0.0 <= x < 1.0:
            raise ConfigError(f"megatron-args: {flag}={x} must be in [0, 1)")
        return x
    if value not in _CHOICE[flag]:
        raise ConfigError(f"megatron-args: {flag}={value!r} must be one of {', '.join(_CHOICE[flag])}")
    return value


def _map(raw: dict[str, Any]) -> dict:
    sec: dict[str, dict[str, Any]] = {"model": {}, "step": {}, "impl": {}, "parallel": {}}
    notes: list[str] = []
    for flag, value in raw.items():
        target = _INT.get(flag)
        if target:
            sec[target[0]][target[1]] = value
    model = sec["model"]
    arch = any(f in raw for f in ("--num-layers", "--hidden-size", "--num-attention-heads"))
    if arch:
        model["family"] = "generic"
        model["activation"] = "swiglu" if raw.get("--swiglu") else "gelu"
        model["norm"] = "rmsnorm" if raw.get("--normalization") == "RMSNorm" else "layernorm"
        bias = not raw.get("--disable-bias-linear")
        model.update(qkv_bias=bias or bool(raw.get("--add-qkv-bias")), out_bias=bias, mlp_bias=bias,
                     norm_bias=model["norm"] == "layernorm", qk_norm=bool(raw.get("--qk-layernorm")),
                     tied_embeddings=not raw.get("--untie-embeddings-and-output-weights"),
                     attn_dropout=raw.get("--attention-dropout", 0.1),
                     hidden_dropout=raw.get("--hidden-dropout", 0.1),
                     embd_dropout=raw.get("--hidden-dropout", 0.1))
        heads = raw.get("--num-attention-heads")
        groups = raw.get("--num-query-groups") if raw.get("--group-query-attention") else None
        if heads:
            model["num_kv_heads"] = groups or heads
        if raw.get("--position-embedding-type", "learned_absolute") == "learned_absolute":
            seq = raw.get("--max-position-embeddings", raw.get("--seq-length"))
            if seq:
                model["max_positions"] = seq
        else:
            model["max_positions"] = 0
        if "ffn_size" not in model and "hidden_size" in model:
            model["ffn_size"] = 4 * model["hidden_size"]  # Megatron's default --ffn-hidden-size
        if "vocab_size" not in model:
            notes.append("no --vocab-size: the vocabulary comes from --model")
    if raw.get("--bf16") and raw.get("--fp16"):
        raise ConfigError("megatron-args: --bf16 and --fp16 are both given")
    sec["step"]["precision"] = "mixed-bf16" if raw.get("--bf16") else "mixed-fp16" if raw.get("--fp16") else "fp32"
    if raw.get("--optimizer"):
        sec["step"]["optimizer"] = {"adam": "adamw", "sgd": "sgd-momentum"}[raw["--optimizer"]]
    _attention(raw, sec["impl"])
    _recompute(raw, sec["impl"], model.get("num_layers"), notes)
    par = sec["parallel"]
    if raw.get("--sequence-parallel"):
        par["sp"] = True
    if raw.get("--use-distributed-optimizer"):
        par["zero"] = 1
    vpp = raw.get("--num-layers-per-virtual-pipeline-stage")
    if vpp:
        pp, layers = par.get("pp", 1), model.get("num_layers")
        if not layers or layers % (pp * vpp):
            raise ConfigError(f"megatron-args: --num-layers={layers} is not a multiple of "
                              f"--pipeline-model-parallel-size={pp} × --num-layers-per-virtual-pipeline-stage={vpp}")
        par.update(schedule="interleaved", virtual_stages=layers // (pp * vpp))
    if "--global-batch-size" in raw:
        notes.append("--global-batch-size needs the data-parallel size to give the gradient accumulation: not applied")
    return answer("megatron", "megatron-args", dict(raw), sec, notes)


def _attention(raw: dict[str, Any], impl: dict[str, Any]) -> None:
    backend = raw.get("--attention-backend")
    if raw.get("--use-flash-attn") or backend in ("flash", "fused"):
        impl["attention"] = "flash"
    elif backend in ("unfused", "local"):
        impl["attention"] = "eager"


def _recompute(raw: dict[str, Any], impl: dict[str, Any], layers: int | None, notes: list[str]) -> None:
    granularity = raw.get("--recompute-granularity")
    if raw.get("--recompute-activations"):  # the older spelling of selective
        granularity = granularity or "selective"
    if granularity == "selective":
        impl["recompute"] = "selective"
    elif granularity == "full":
        impl["recompute"] = "full"
        method, n = raw.get("--recompute-method"), raw.get("--recompute-num-layers", 1)
        if method == "block" and (layers is None or n < layers):
            notes.append(f"--recompute-method block with --recompute-num-layers {n}: modelled as full recompute "
                         f"of every layer (this underestimates the memory)")
        elif method == "uniform" and n > 1:
            notes.append(f"--recompute-method uniform with --recompute-num-layers {n}: modelled as full recompute "
                         f"of every layer (approximate)")
