"""The backward of a Llama block compiled around its checkpoint with torchao's Float8 ``rowwise`` (``--float8 rowwise
--compile --compile-scope block --recompute full``), bf16, as a timeline of allocations.

The block keeps its input alone (``rules_compiled.py`` ``_checkpointed_block``). Its partitioned backward
(``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``: the ``tag_activation_checkpoint`` region
is recomputed) runs, read off the trace (``trace/compiled.py``: the partitioned graphs op by op on fake tensors):

* down_proj's input gradient first (its grad_output cast per row, the abs and fp32 copy held for the per-column cast
  of its weight gradient; the weight cast per column; the mm and its fp32 output scaling:
  estimate/compiled_float8_rowwise.py ``Timeline.input_gradient``);
* the block's forward again up to ``silu(gate)·up``: each RMSNorm (fp32 input, ``rsqrt``, the normalized product and
  the output held for the backward), each linear's input cast per row (float8_scaling_utils.py
  ``hp_tensor_to_float8_dynamic``, its inverse scale made by the first reader's mm and freed after the last's), each
  weight cast per output (``matmul_with_hp_or_float8_args.forward``): rowwise casts a weight along the other axis
  for the input gradient, so the joint graph holds the forward cast's ``abs`` and fp32 copy until then (the
  CSE-merged nodes both casts read); the forward mms run with fast accumulation (torchao/float8/config.py
  ``Float8LinearConfig.gemm_config_output``): ``_scaled_mm`` takes the inverse scales, and float8_ops.py
  ``addmm_float8_unwrapped`` adds no fp32 output scaling; the rotary embedding of q and k, SDPA's output and
  log-sum-exp; SiLU's fp32 gate and its output; up and the product;
* then the MLP's backward as without checkpointing (compiled_float8_rowwise.py), each weight's input-gradient cast
  made from the held ``abs`` and fp32 copy, the gate/up input's norm output held (not recomputed again).

:func:`rowwise_checkpoint_moments` returns a moment at every allocation of that replay (the amax and power-of-2 scale
chains' transients of a few bytes per row left out, as in compiled_float8_rowwise.py), beside the residual gradient;
every value of the recomputed set and the checkpoint's input counts as freed, and what is alive is the replay's own.
Checked: tests/estimate/test_float8_compiled_recompute.py (``ROWWISE_FULL_CASES``, estimate == trace to the byte).

Known limitations: bf16 only (``check_compiled``); the attention's and the input norm's backward after the MLP's are
not replayed (the weights' held copies of q, k, v and o are freed there, one at a time); inductor fuses the casts and
the output scaling (no fp32 copies on a GPU): this is the unfused graph's moment, as the other compiled moments are.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from trainmem.estimate.compiled_float8_rowwise import Timeline
from trainmem.inventory import MemoryItem, dtype_bytes

__all__ = ["Dims", "Forward", "block_dims", "rowwise_checkpoint_moments"]

_FP32 = dtype_bytes("float32")
_NEEDED = ("self_attn.q_rope", "self_attn.k_rope", "self_attn.v_proj.out", "self_attn.sdpa_out", "self_attn.lse",
           "self_attn.o_proj.out", "mlp.gate_proj.out", "mlp.up_proj.out")


@dataclass(frozen=True)
class Dims:
    """A bf16 rowwise block's sizes, read off its compiled saved set: bytes per activation element ``a``, T·H ``th``
    and T·F ``tf`` elements, the hidden and MLP widths, the tokens T, F·H, the attention's q and k/v features."""

    a: int
    th: int
    tf: int
    hidden: int
    ffn: int
    tokens: int
    fh: int
    width: int
    kv: int


def block_dims(kept: dict[str, MemoryItem], residual_bytes: int) -> "Dims | None":
    """:class:`Dims` of the block whose compiled saved set without checkpointing is ``kept`` (by path inside the
    block), or None unless it holds what the replays read and its residual stream is in the linears' dtype."""
    if any(n not in kept for n in _NEEDED):
        return None
    gate, o, q, k = (kept[n] for n in ("mlp.gate_proj.out", "self_attn.o_proj.out", "self_attn.q_rope",
                                       "self_attn.k_rope"))
    a = dtype_bytes(gate.dtype)
    th, tf = o.bytes // a, gate.bytes // a  # T·H, T·F
    hidden, ffn = o.shape[-1], gate.shape[-1]
    tokens = th // hidden
    if residual_bytes != th * a:
        return None
    return Dims(a, th, tf, hidden, ffn, tokens, ffn * hidden, q.bytes // a // tokens, k.bytes // a // tokens)


class Forward(Timeline):
    """The recomputed forward's steps (module docstring) on top of the backward's timeline."""

    def norm(self, name: str, th: int, tokens: int, *, a: int, src: str = "") -> None:
        """An RMSNorm (``LlamaRMSNorm.forward``): the fp32 input (``src`` freed by it), ``pow``, the row mean and
        ``rsqrt`` (B·S fp32), ``x·rsqrt`` in fp32, the normalized product in the input's dtype and the output held."""
        self.new(f"{name}.x32", th * _FP32)
        if src:
            self.drop(src)
        self.new(f"{name}.pow", th * _FP32)
        self.new(f"{name}.mean", tokens * _FP32)
        self.drop(f"{name}.pow")
        self.chain(((f"{name}.add", f"{name}.mean"), (f"{name}.rsqrt", f"{name}.add")), tokens * _FP32)
        self.new(f"{name}.xr", th * _FP32)
        self.new(f"{name}.normed", th * a)
        self.drop(f"{name}.xr")
        self.new(f"{name}.out", th * a)

    def linear(self, name: str, x: str, out: int, weight: int, tokens: int, *, a: int, first: bool, last: bool) -> None:
        """A converted linear's forward on the cast input ``x``: its weight cast per output (``abs`` and fp32 copy
        held for the input gradient's cast), ``_scaled_mm`` with the inverse scales (the input's made by its first
        reader, freed after its last), ``name`` its output (``out`` features)."""
        self.cast(f"w_{name}", weight, out, a=a, keep=True)
        if first:
            self.new(f"{x}.inv", tokens * _FP32)
            self.drop(f"{x}.scale")
        self.new(f"w_{name}.inv", out * _FP32)
        self.drop(f"w_{name}.scale")
        self.new(name, tokens * out * a)
        if last:
            self.drop(f"{x}.fp8")
        self.drop(f"w_{name}.fp8")
        if last:
            self.drop(f"{x}.inv")
        self.drop(f"w_{name}.inv")

    def attention(self, d: Dims, kept: dict[str, MemoryItem], linears: tuple[str, ...]) -> None:
        """The attention's forward again: the input norm, q/k/v's input cast per row, ``linears`` of q, k, v (the
        others kept: the cast's inverse scale then saved, its scale freed once the scaled product is made), the rotary
        embedding of q and k, SDPA's output and log-sum-exp."""
        a, tokens = d.a, d.tokens
        self.norm("ln1", d.th, tokens, a=a)
        self.cast("x_qkv", d.th, tokens, a=a, inverse_saved=linears[0] != "q")
        for name in linears:
            out = d.width if name == "q" else d.kv
            self.linear(name, "x_qkv", out, out * d.hidden, tokens, a=a, first=name == "q", last=name == linears[-1])
        self.rope("q", tokens * d.width, a=a)
        self.rope("k", tokens * d.kv, a=a)
        self.new("sdpa_out", kept["self_attn.sdpa_out"].bytes)
        self.new("lse", kept["self_attn.lse"].bytes)

    def o_proj_and_norm(self, d: Dims, *, inverse_saved: bool, free_input: bool = True) -> None:
        """o_proj on the SDPA output cast per row, the residual sum (o freed, and the block input ``x_in`` unless
        the attention's recompute still reads it), the second norm, the gate/up input's cast per row
        (``inverse_saved``: Timeline.cast)."""
        a, tokens = d.a, d.tokens
        self.cast("x_o", tokens * d.width, tokens, a=a)
        self.linear("o", "x_o", d.hidden, d.hidden * d.width, tokens, a=a, first=True, last=True)
        self.new("resid", d.th * a)
        self.drop(*(("x_in", "o") if free_input else ("o",)))
        self.norm("ln2", d.th, tokens, a=a, src="resid")
        self.cast("x_mlp", d.th, tokens, a=a, inverse_saved=inverse_saved)

    def mlp(self, th: int, tf: int, tokens: int, hidden: int, *, a: int, gate_held: bool) -> None:
        """From the gate (``gate``, live) and the cast gate/up input (``x_mlp``) on: SiLU (the gate's fp32 copy, the
        16-bit gate freed, sigmoid's chain two at a time, its output), up's forward, the product, then the MLP's
        backward (compiled_float8_rowwise.py), up's weight cast for its input gradient from its held copies, gate's
        too where its forward ran here (``gate_held``), else afresh."""
        ffn = tf // tokens
        self.new("gate32", tf * _FP32)
        self.drop("gate")
        self.chain((("neg", ""), ("exp", "neg"), ("add", "exp"), ("silu32", "add")), tf * _FP32)
        self.new("silu", tf * a)
        self.drop("silu32")
        self.linear("up", "x_mlp", ffn, ffn * hidden, tokens, a=a, first=False, last=True)
        self.new("prod", tf * a)
        self.weight_gradient("down", th, "prod8", tf, tokens, a=a, src="prod")
        self.new("g_up_src", tf * a)
        self.drop("silu")
        self.new("g_silu", tf * a)
        self.drop("dx_down", "up")
        self.input_gradient("up", tf, tokens, hidden, ffn * hidden, a=a, src="g_up_src", weight_kept=True)
        self.weight_gradient("up", tf, "ln2.x8", th, tokens, a=a, src="ln2.out", keep_x=True)
        self.silu_backward(tf, a=a)
        self.input_gradient("gate", tf, tokens, hidden, ffn * hidden, a=a, src="g_gate_src", weight_kept=gate_held)
        self.weight_gradient("gate", tf, "ln2.x8", th, tokens, a=a)

    def rope(self, name: str, numel: int, *, a: int) -> None:
        """``apply_rotary_pos_emb`` on a projection: ``x·cos``, ``rotate_half`` (``neg`` of a half, ``cat``), its
        product with ``sin`` and the sum (held: SDPA's input); the projection freed by ``rotate_half``."""
        self.new(f"{name}.cos", numel * a)
        self.new(f"{name}.neg", numel // 2 * a)
        self.new(f"{name}.cat", numel * a)
        self.drop(f"{name}.neg", name)
        self.new(f"{name}.sin", numel * a)
        self.drop(f"{name}.cat")
        self.new(f"{name}.rope", numel * a)
        self.drop(f"{name}.cos", f"{name}.sin")


def rowwise_checkpoint_moments(kept: dict[str, MemoryItem], residual_bytes: int) -> list[dict[str, int]]:
    """A moment at every allocation of the replayed backward (module docstring) of a checkpointed block whose compiled
    saved set without checkpointing is ``kept`` (by path inside the block: the bf16 rowwise Llama set,
    compiled_float8_rowwise.py ``is_rowwise_block``), beside the residual gradient (``residual_bytes``)."""
    d = block_dims(kept, residual_bytes)
    if d is None:
        return []
    a, th, tf, hidden, ffn, tokens, fh, width, kv = astuple(d)
    # every value of the recomputed set and the checkpoint's input (held as "x_in" until the residual sum) count as
    # freed: what is alive is the replay's own
    t = Forward(residual_bytes, sum(i.bytes for i in kept.values()) + th * a)
    t.new("x_in", th * a)
    t.input_gradient("down", th, tokens, ffn, fh, a=a)
    # the recomputed forward: the input norm, q/k/v's input cast per row, the projections, the rotary, SDPA
    t.attention(d, kept, ("q", "k", "v"))
    # o_proj on the SDPA output cast per row, the residual sum (the block input and o freed), the second norm
    t.o_proj_and_norm(d, inverse_saved=False)
    t.linear("gate", "x_mlp", ffn, fh, tokens, a=a, first=True, last=False)
    t.mlp(th, tf, tokens, hidden, a=a, gate_held=True)
    return t.moments
