"""Symbolic dimensions: one expression per tensor axis, rendered into formulas and evaluated.

A tensor's dims are a tuple with one entry per axis (``("B", "S", "A·hd")``). An entry is a small
expression over the symbols below, numbers, ``·`` (product), ``/`` (exact quotient), ``+``,
parentheses, ``⌈x/y⌉`` and ``⌊x/y⌋``; ``2F`` is ``2·F``. Formulas are rendered from dims only at
the edge (:func:`formula`), so nothing ever parses a formula back to learn a shape -- except
:func:`evaluate`, which exists to check that a formula's value is the item's bytes.

Symbols (global values; a rank's local sizes appear as quotients such as ``A/tp``):

=======  =========================================  =======  ==================================
B        micro-batch                                S        sequence
H        hidden size                                V        vocabulary
A        attention heads                            Akv      key/value heads
hd       head dimension                             rot      rotary dimensions (NeoX)
F        MLP width                                  Fe       one expert's width
E        routed experts                             k        experts per token
Es       shared experts                             r        LoRA rank
ctx      cached context (inference)                 tp, cp   tensor / context parallel degrees
=======  =========================================  =======  ==================================
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Mapping

__all__ = ["formula", "render", "substitute", "names", "evaluate", "scaling", "symbol_values"]

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Za-z_][A-Za-z_0-9]*)|(.))")


def _tokens(expr: str) -> list[tuple[str, str]]:
    out = []
    for num, name, op in _TOKEN.findall(expr):
        if num:
            out.append(("num", num))
        elif name:
            out.append(("name", name))
        elif op.strip():
            out.append(("op", op))
    return out


def names(expr: str) -> set[str]:
    """The symbols an expression mentions."""
    return {v for kind, v in _tokens(expr) if kind == "name"}


def _top_level_has(expr: str, ops: str) -> bool:
    depth = 0
    for c in expr:
        if c in "(⌈⌊":
            depth += 1
        elif c in ")⌉⌋":
            depth -= 1
        elif depth == 0 and c in ops:
            return True
    return False


def render(dims: tuple[str, ...]) -> str:
    """The product of the axes (unit axes left out; ``1`` for a scalar)."""
    parts = [f"({d})" if _top_level_has(d, "+-/") else d for d in dims if d != "1"]
    return "·".join(parts) or "1"


def formula(dims: tuple[str, ...], item_bytes: float) -> str:
    """``render(dims)·bytes``: the formula shown beside an item (``B·S·H·2``)."""
    b = str(int(item_bytes)) if item_bytes == int(item_bytes) else str(item_bytes)
    return f"{render(dims)}·{b}"


def substitute(expr: str, subs: Mapping[str, str]) -> str:
    """Replace whole symbols (``A`` -> ``A/tp``, not the A of ``Akv``). A quotient is
    parenthesized unless it starts a quotient of its own (``S/tp`` -> ``S/cp/tp``, ``A·hd`` ->
    ``(A/tp)·hd``); a sum always is."""
    if not subs:
        return expr

    def one(m: re.Match) -> str:
        if m.group(1) is not None:
            return m.group(0)
        new = subs.get(m.group(2))
        if new is None:
            return m.group(0)
        before = expr[m.start() - 1] if m.start() else ""
        after = expr[m.end()] if m.end() < len(expr) else ""
        bare = before in ("", "(", "⌈", "⌊") and after in ("", "/", ")", "⌉", "⌋")
        if _top_level_has(new, "+-") or (not bare and _top_level_has(new, "/")):
            return f"({new})"
        return new

    return re.sub(r"(\d+(?:\.\d+)?)|([A-Za-z_][A-Za-z_0-9]*)", one, expr)


def evaluate(expr: str, values: Mapping[str, int]) -> Fraction:
    """The exact value of a formula or axis expression under ``values`` (a KeyError names an
    unknown symbol; a ValueError a malformed expression)."""
    toks = _tokens(expr)
    pos = 0

    def peek() -> tuple[str, str] | None:
        return toks[pos] if pos < len(toks) else None

    def take(op: str) -> None:
        nonlocal pos
        if peek() != ("op", op):
            raise ValueError(f"expected {op!r} at token {pos} of {expr!r}")
        pos += 1

    def atom() -> Fraction:
        nonlocal pos
        t = peek()
        if t is None:
            raise ValueError(f"unexpected end of {expr!r}")
        kind, v = t
        pos += 1
        if kind == "num":
            n = Fraction(v)
            nxt = peek()  # 2F, 2(x): a number multiplies what follows it directly
            if nxt and (nxt[0] == "name" or nxt == ("op", "(")):
                return n * atom()
            return n
        if kind == "name":
            if v not in values:
                raise KeyError(f"unknown symbol {v!r} in {expr!r}")
            return Fraction(values[v])
        if v == "(":
            x = total()
            take(")")
            return x
        if v in "⌈⌊":
            x = total()
            take("⌉" if v == "⌈" else "⌋")
            return Fraction(-(-x.numerator // x.denominator) if v == "⌈" else x.numerator // x.denominator)
        raise ValueError(f"unexpected {v!r} in {expr!r}")

    def product() -> Fraction:
        nonlocal pos
        x = atom()
        while (t := peek()) and t[0] == "op" and t[1] in "·×/":
            pos += 1
            y = atom()
            x = x / y if t[1] == "/" else x * y
        return x

    def total() -> Fraction:
        nonlocal pos
        x = product()
        while (t := peek()) and t[0] == "op" and t[1] in "+-−":
            pos += 1
            y = product()
            x = x + y if t[1] == "+" else x - y
        return x

    out = total()
    if pos != len(toks):
        raise ValueError(f"trailing {toks[pos][1]!r} in {expr!r}")
    return out


def scaling(dims: tuple[str, ...], symbol: str, factor: int, values: Mapping[str, int]) -> Fraction:
    """How a tensor's size scales when ``symbol`` is multiplied by ``factor``, every other symbol at
    ``values``: the product over axes of each axis' value after over before. An axis need not be a
    power of the symbol: an affine one (``S+1``, the loss's labels padded at B=1) scales by
    ``(2S+1)/(S+1)``, a padded one (``⌈S/32⌉``) by its own rounding, a quadratic tensor
    (``("B", "A", "S", "S")``) by ``factor²``; an axis without the symbol by 1 (its own symbols
    need no value: ``rows``, the routed rows of a MoE block, has none)."""
    scaled = {symbol: f"{factor}·{symbol}"}
    out = Fraction(1)
    for d in dims:
        if symbol in names(d):
            out *= evaluate(substitute(d, scaled), values) / evaluate(d, values)
    return out


def symbol_values(model, step, parallel=None, *, lora_rank: int = 0, context: int = 0) -> dict[str, int]:
    """Each symbol's value for a model, step and parallel layout (global sizes, not a rank's)."""
    p = parallel
    return {
        "B": step.batch, "S": step.seq, "H": model.hidden_size, "V": model.vocab_size,
        "A": model.num_heads, "Akv": model.num_kv_heads, "hd": model.head_dim,
        "rot": model.rotary_dim or model.head_dim, "F": model.ffn_size, "Fe": model.expert_ffn_size,
        "E": model.num_experts, "k": model.top_k, "Es": model.num_shared_experts, "r": lora_rank,
        "nl": getattr(model, "num_labels", 0),
        # MLA (DeepSeek-V2/V3, rules_mla.py): the q and kv latent ranks, the per-head nope / rope / v dims
        "Rq": model.q_lora_rank, "Rkv": model.kv_lora_rank, "nope": model.qk_nope_head_dim,
        "rope": model.qk_rope_head_dim, "vd": model.v_head_dim,
        "ctx": context, "tp": p.tp if p else 1, "cp": p.cp if p else 1,
    }
