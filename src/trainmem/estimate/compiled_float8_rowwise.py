"""The MLP backward of a compiled Llama block with torchao's Float8 ``rowwise`` and no checkpointing
(``--float8 rowwise --compile --compile-scope block --recompute none``), bf16, as a timeline of allocations.

The block keeps no scale (``estimate/float8.py`` ``compiled_scales``) and recomputes the post-attention norm's output
and ``act(gate)·up`` (``compiled_input_recomputed``). torchao's ``rowwise`` recipe (torchao/float8/config.py
``Float8LinearConfig.from_recipe_name``: axiswise scales, ``round_scales_to_power_of_2``) casts each operand of the
backward mms along the axis its mm reduces: a grad_output per row for the input gradient and per column for the
weight gradient (the second cast reads the first one's ``abs`` and fp32 copy, both held until then), a weight per
output column, the recomputed input per column. Each cast (float8_scaling_utils.py ``hp_tensor_to_float8_dynamic``:
``tensor.to(float32) * scale``, ``to_fp8_saturated``'s two clamps) holds two fp32 copies at a time. The backward mms run
without fast accumulation (``Float8GemmConfig`` default), so torchao/float8/float8_ops.py ``addmm_float8_unwrapped``
scales the output after ``_scaled_mm``: ``a_inverse_scale * b_inverse_scale`` (an fp32 outer product, output-sized),
the bf16 output multiplied by it in fp32 and cast back, beside a ``new_ones(())`` scalar made once per graph.

:func:`rowwise_uncheckpointed_moments` replays that order (read off the trace, ``trace/compiled.py``: the partitioned
graph run op by op on fake tensors, no fusion) from down_proj's backward to gate_proj's weight gradient and returns a
moment at every allocation. Checked: tests/estimate/test_float8_compiled_recompute.py (``NONE_CASES`` rowwise_*).

Known limitations: bf16 only (fp16 and fp32 outputs go through bf16 and back: other temporaries, not read); the amax
and power-of-2 scale chains (a few bytes per row) are left out; the attention's and the norms' backward are not
replayed (lower than the MLP's where traced); inductor fuses the casts and the output scaling (no fp32 copies).
"""

from __future__ import annotations

from trainmem.inventory import MemoryItem, dtype_bytes

__all__ = ["Timeline", "is_rowwise_block", "rowwise_uncheckpointed_moments"]

_FP32 = dtype_bytes("float32")
_KEPT = ("post_attention_layernorm.rsqrt", "self_attn.o_proj.out", "self_attn.k_rope", "mlp.gate_proj.out",
         "mlp.up_proj.out")


def is_rowwise_block(kept: dict[str, MemoryItem]) -> bool:
    """Whether ``kept`` (a block's compiled saved set by path inside the block) is the Float8 ``rowwise`` Llama set in
    bf16: the post-attention norm's output and the product recomputed, no scale kept."""
    return (all(n in kept for n in _KEPT) and kept["mlp.gate_proj.out"].dtype == "bfloat16"
            and not any(n in kept for n in ("mlp.act_mul_up", "post_attention_layernorm.out"))
            and not any(n.endswith((".amax", ".scale_inv")) for n in kept))


class Timeline:
    """What the block's backward holds beyond its saved set: ``work`` (named temporaries), the saved bytes it freed
    and the weight gradients it made; a moment (dict as ``uncheckpointed_moments``') at every allocation."""

    def __init__(self, base: int, freed: int):
        self.live: dict[str, int] = {}
        self.base, self.freed, self.grads = base, freed, 0
        self.moments: list[dict[str, int]] = []

    def new(self, name: str, nbytes: int) -> None:
        self.live[name] = nbytes
        self.mark()

    def mark(self) -> None:
        self.moments.append({"block_gradients": self.grads, "new_gradients": self.grads, "after_attention": 0,
                             "freed_activations": self.freed, "work": self.base + sum(self.live.values())})

    def drop(self, *names: str) -> None:
        for n in names:
            del self.live[n]

    def cast(self, name: str, numel: int, scale: int, *, a: int, src: str = "", keep: bool = False,
             kept: bool = False, clone: bool = False, inverse_saved: bool = False) -> None:
        """One fp8 cast (module docstring) into ``name``: ``keep`` holds its abs and fp32 copy for the other axis's
        cast, ``kept`` is that cast (from them), ``src`` a temporary freed by the fp32 copy, ``clone`` the weight's
        contiguous copy for ``_scaled_mm``; ``inverse_saved``: its inverse scale is a saved tensor (an op-level
        policy's, compiled_float8_rowwise_op.py), so the scale is freed once the scaled product is made."""
        if kept:
            self.drop(f"{name}.abs")
        else:
            self.new(f"{name}.abs", numel * a)
            if not keep:
                self.drop(f"{name}.abs")
        self.new(f"{name}.scale", scale * _FP32)
        if not kept:
            self.new(f"{name}.fp32", numel * _FP32)
            if src:
                self.drop(src)
        if not keep:  # the scaled product reads the fp32 copy, then frees it (unless the other axis reads it too)
            self.new(f"{name}.mul", numel * _FP32)
            self.drop(f"{name}.fp32")
            if inverse_saved:
                self.drop(f"{name}.scale")
        else:
            self.new(f"{name}.mul", numel * _FP32)
        self.new(f"{name}.clamp_min", numel * _FP32)
        self.drop(f"{name}.mul")
        self.new(f"{name}.clamp_max", numel * _FP32)
        self.drop(f"{name}.clamp_min")
        self.new(f"{name}.fp8", numel)
        self.drop(f"{name}.clamp_max")
        if clone:
            self.new(f"{name}.t", numel)
            self.drop(f"{name}.fp8")

    def mm(self, out: str, left: str, right: str, rows: int, cols: int, *, a: int, keep_right: bool = False,
           grad: bool = False) -> None:
        """``addmm_float8_unwrapped`` without fast accumulation: the inverse scales' outer product, ``_scaled_mm``'s
        bf16 output, their fp32 product, cast back (a weight gradient once made: ``grad``)."""
        self.new(f"{out}.inv_a", rows * _FP32)
        self.drop(f"{left}.scale")
        if f"{right}.inv" not in self.live:  # a kept right operand's was made by its first mm
            self.new(f"{right}.inv", cols * _FP32)
            self.drop(f"{right}.scale")
        self.new(f"{out}.post", rows * cols * _FP32)
        self.drop(f"{out}.inv_a")
        if not keep_right:
            self.drop(f"{right}.inv")
        if "ones" not in self.live:
            self.new("ones", _FP32)  # new_ones(()): one per graph
        self.new(f"{out}.raw", rows * cols * a)
        self.drop(self._operand(left), *([] if keep_right else [self._operand(right)]))
        self.new(f"{out}.mul", rows * cols * _FP32)
        self.drop(f"{out}.raw", f"{out}.post")
        if grad:
            self.grads += rows * cols * a
            self.mark()
        else:
            self.new(out, rows * cols * a)
        self.drop(f"{out}.mul")

    def _operand(self, name: str) -> str:
        return f"{name}.t" if f"{name}.t" in self.live else f"{name}.fp8"

    def chain(self, steps: tuple[tuple[str, str], ...], nbytes: int) -> None:
        """Pointwise ops of one size: each (made, freed) pair in order, either side empty."""
        for made, gone in steps:
            if made:
                self.new(made, nbytes)
            if gone:
                self.drop(gone)

    def weight_gradient(self, name: str, numel: int, x: str, x_numel: int, tokens: int, *, a: int, src: str = "",
                        keep_x: bool = False) -> None:
        """A linear's weight gradient: its grad_output (``numel``) cast per column from the held abs and copy, its input
        ``x`` (``x_numel``, ``src`` freed by the fp32 copy; unless cast already) per column, each cast copied
        contiguous for ``_scaled_mm`` (the cast freed), the mm; ``keep_x``: ``x``'s cast is read again."""
        rows, cols = numel // tokens, x_numel // tokens
        self.cast(f"g_{name}", numel, rows, a=a, kept=True)
        if f"{x}.t" not in self.live:
            self.cast(x, x_numel, cols, a=a, src=src)
        for op, n in ((f"g_{name}", numel), (x, x_numel)):
            if f"{op}.fp8" in self.live:
                self.new(f"{op}.t", n)
                self.drop(f"{op}.fp8")
        self.mm(f"dw_{name}", f"g_{name}", x, rows, cols, a=a, keep_right=keep_x, grad=True)

    def input_gradient(self, name: str, numel: int, rows: int, cols: int, weight: int, *, a: int,
                       src: str = "", weight_kept: bool = False) -> None:
        """A linear's input gradient: its grad_output (``numel``, ``rows`` of it) cast per row, abs and fp32 copy held
        for the weight gradient's cast; its weight (``weight`` elements, ``cols`` outputs) cast per column
        (``weight_kept``: from the abs and fp32 copy its forward cast held, compiled_float8_rowwise_recompute.py); the
        mm."""
        self.cast(f"g_{name}", numel, rows, a=a, keep=True, src=src)
        self.cast(f"w_{name}", weight, cols, a=a, clone=True, kept=weight_kept)
        self.mm(f"dx_{name}", f"g_{name}", f"w_{name}", rows, cols, a=a)

    def silu_backward(self, tf: int, *, a: int) -> None:
        """SiLU's backward in fp32 (``silu_backward`` decomposed: the upcast gradient, sigmoid, their products), the
        gate's fp32 copy and SiLU's gradient ``g_silu`` freed, gate's grad_output ``g_gate_src`` (T·F·a) made."""
        self.new("s_up32", tf * _FP32)
        self.drop("g_silu")
        self.chain((("sig", ""), ("s_mul", "s_up32"), ("sub", "sig"), ("s_mul2", "gate32"), ("", "sub"),
                    ("s_add", "s_mul2"), ("s_mul3", "s_mul"), ("", "s_add")), tf * _FP32)
        self.new("g_gate_src", tf * a)
        self.drop("s_mul3")


def rowwise_uncheckpointed_moments(kept: dict[str, MemoryItem], residual_bytes: int, *,
                                   tangents: int) -> list[dict[str, int]]:
    """A moment at every allocation of the MLP's backward (module docstring) for a block whose saved set is ``kept``
    (:func:`is_rowwise_block`), beside the residual gradient and the zero-filled KV-cache tangents."""
    gate, up, o = kept["mlp.gate_proj.out"], kept["mlp.up_proj.out"], kept["self_attn.o_proj.out"]
    a = dtype_bytes(gate.dtype)
    th, tf = o.bytes // a, gate.bytes // a  # T·H, T·F
    hidden, ffn = o.shape[-1], gate.shape[-1]
    tokens, fh = th // hidden, ffn * hidden
    if residual_bytes != th * a:
        return []
    out = kept["residual_mlp"].bytes if "residual_mlp" in kept else 0  # the block output, freed by its reader
    t = Timeline(residual_bytes + tangents, out)
    t.input_gradient("down", th, tokens, ffn, fh, a=a)
    # act(gate)·up recomputed: the gate's fp32 copy (the bf16 gate freed), sigmoid's chain two at a time
    t.new("gate32", tf * _FP32)
    t.freed += gate.bytes
    t.chain((("neg", ""), ("exp", "neg"), ("add", "exp"), ("silu32", "add")), tf * _FP32)
    t.new("silu", tf * a)
    t.drop("silu32")
    t.new("prod", tf * a)
    t.weight_gradient("down", th, "prod8", tf, tokens, a=a, src="prod")
    # the product's backward: up's grad_output (grad·silu) and SiLU's (grad·up); silu, dX and up freed
    t.new("g_up_src", tf * a)
    t.drop("silu")
    t.new("g_silu", tf * a)
    t.drop("dx_down")
    t.freed += up.bytes
    t.input_gradient("up", tf, tokens, hidden, fh, a=a, src="g_up_src")  # the bf16 grad_output freed by its fp32 copy
    # the post-attention norm recomputed: the residual sum (o freed), its fp32 copy, x·rsqrt, the bf16 product, output
    t.new("resid", th * a)
    t.freed += o.bytes
    t.new("x32", th * _FP32)
    t.drop("resid")
    t.new("xr", th * _FP32)
    t.new("normed", th * a)
    t.drop("xr")
    t.new("norm_out", th * a)
    t.weight_gradient("up", tf, "x8", th, tokens, a=a, src="norm_out", keep_x=True)  # x8 read by gate_proj's too
    # SiLU's backward in fp32 (the upcast gradient, sigmoid, products), the gate's fp32 copy freed, gate's grad_output
    t.silu_backward(tf, a=a)
    # gate_proj: as up_proj, its weight gradient reading the norm output's held cast
    t.input_gradient("gate", tf, tokens, hidden, fh, a=a, src="g_gate_src")
    t.weight_gradient("gate", tf, "x8", th, tokens, a=a)
    return t.moments
