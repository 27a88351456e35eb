"""Where a checkpointed block's recomputation stops: the moment before its MLP's backward nodes run.

A non-reentrant checkpoint recomputes the block's forward when backward first unpacks one of its saved
tensors, and stops it (``_StopRecomputationError``) as soon as the last tensor the forward saved has been
saved again (torch/utils/checkpoint.py ``_recomputation_hook.pack_hook``, early stop on by default). An op
saves its inputs when its node is set up, before its kernel runs (the generated ``VariableType`` code), so
when the block's last saved tensor is its down projection's (its input, or under autocast its bf16 weight
copy), the recomputation stops there and neither the projection's output nor the block's output is made.
At that moment, beside every tensor recomputed so far and what the backward holds (the residual stream's
gradient, and under autocast its bf16 cast for the MLP branch's output, ``validate_outputs`` in
torch/csrc/autograd/engine.cpp), the forward's locals are alive, saved or not:

* the MLP's input (the norm's output, the residual stream's shape and dtype): the decoder layer's
  ``hidden_states`` and the MLP's argument (transformers ``LlamaDecoderLayer.forward`` /
  ``LlamaMLP.forward``, ``GPTNeoXLayer.forward``). Not saved when the MLP's projections are frozen (LoRA on
  the attention: ``mm`` keeps its input only for the weight's gradient) or autocast saves their bf16
  copies instead;
* the down projection's input (``act_fn(gate) * up``, GPT-NeoX's GELU output) when a frozen projection does
  not save it;
* the down projection's bf16 bias copy: autocast's ``linear`` wrapper casts its arguments before the
  weight's (the traces show bias, weight, input);
* a parallel-residual block's attention output (``GPTNeoXLayer``: ``mlp_output + attn_output +
  hidden_states``), held by the layer until the sum, and GPT-2's, which its block keeps in a local
  (:data:`_FRAME_KEEPS_ATTENTION_OUTPUT`);
* past a down projection that saves nothing after it but a dropout mask (GPT-2's), the projection's output.

With LoRA's frozen MLP this moment outgrows the MLP product's (no weight gradient there): tiny Llama
(h64, F176) amp-bf16 full recompute B1 S64 was 2,048 B under the trace, GPT-NeoX (h128, F512) B2 S64
65,800 B under; both tops are the down projection's weight copy (``_to_copy``) inside the recomputation.

In the first block (``backward_first_block``) the moment is the same one: under transformers' checkpointing the
frozen embedding's output requires a gradient (``enable_input_require_grads``), so block 0's recomputation saves
what every block's does (the recomputed set is built so: ``Ctx.checkpointed``, estimate/rules_hf_parts.py
``_embedding``). Taken from an eager block 0, whose input needs no gradient (no q/k/v weight copies, no lora_A
copies, no input-norm rsqrt), LoRA on q, v and the MLP at amp-bf16 B1 S32 read 18,560 B (tiny Llama) and 40,960 B
(GPT-NeoX) under the trace, whose top was there.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["recompute_stop_moment", "adapter_down_moments", "adapter_up_forward"]


def recompute_stop_moment(block: list[MemoryItem], acts: list[MemoryItem], unsaved: list[MemoryItem], *,
                          down: str, start: int, last: int, residual_bytes: int,
                          tail: tuple[str, ...] = ()) -> dict[str, int] | None:
    """The stop of a checkpointed block's recomputation at its down projection (module docstring).
    ``acts``: the recomputed block's saved tensors in forward order, the MLP's from ``start`` to ``last``
    (its down projection's saved input, or the last tensor before it when a frozen one saves none);
    ``unsaved``: the block's zero-byte markers (what a frozen linear does not save, estimate/finetune.py);
    ``tail``: what the MLP saves after its down projection (GPT-2's dropout mask): the recomputation runs past
    the projection, whose output is made while its input and bias copy are alive (the MLP's frame drops the
    input when it rebinds ``hidden_states``, transformers ``GPT2MLP.forward``, before the dropout saves its mask).
    None when a tensor the moment cannot place is saved after the MLP."""
    copy = f".mlp.{down}.weight_cast"
    out = next((i for i in acts[last + 1:] if i.name.endswith(".residual_mlp")), None)
    after = [i for i in acts[last + 1:] if i.name.split(".mlp.", 1)[-1] in tail]
    if out is None or any(not (i is out or i in after or i.name.endswith(copy)) for i in acts[last + 1:]):
        return None
    mlp = [i for i in acts[start:last + 1] if ".mlp." in i.name]
    # a frozen projection's marker: its input's shape and dtype (estimate/finetune.py), not saved
    marker = {i.name.split(".mlp.", 1)[1].split(".", 1)[0]: i for i in unsaved if ".mlp." in i.name
              and i.name.endswith(".input") and i.shape}
    x = next((_bytes(i) for name, i in marker.items() if name != down), 0)
    if not x and any(i.name.endswith(".input_cast") for i in mlp + acts[:start] if ".mlp." in i.name):
        x = residual_bytes  # autocast saved the projections' bf16 copies of it
    down_input = _bytes(marker[down]) if down in marker else 0
    prod_dtype = (marker[down] if down in marker else acts[last]).dtype
    branch = residual_bytes * dtype_bytes(prod_dtype) // dtype_bytes(out.dtype)  # the branch's output, its dtype
    weight_copy = next((i for i in acts if i.name.endswith(copy)), None)
    bias = next((i for i in block if i.category is Category.PARAMETER and i.name.endswith(f".mlp.{down}.bias")
                 and i.shape), None)
    bias_copy = math.prod(bias.shape) * dtype_bytes(weight_copy.dtype) if bias and weight_copy else 0
    held = _attention_output_held(acts)
    gathered = _sequence_gathered([i for i in acts[:last + 1] if ".mlp." in i.name], out)
    if gathered > 1:  # --sp: the MLP's all-gathered input beside the norm's local output; the branch's gathered gradient
        x += residual_bytes * gathered
        branch *= gathered
    return {"block_gradients": 0, "freed_activations": out.bytes + sum(i.bytes for i in after), "after_attention": 0,
            "work": residual_bytes + (branch if prod_dtype != out.dtype else 0) + x + down_input
            + int(bias_copy) + (branch if held else 0) + (branch if after else 0)}


def _sequence_gathered(mlp: list[MemoryItem], out: MemoryItem) -> int:
    """How many sequence shards the MLP's input gathers: 1 on one device and under TP without ``--sp``; under
    sequence parallelism ``tp`` (the MLP's ``PrepareModuleInput`` all-gathers ``hidden_states`` from ``Shard(1)``
    to ``Replicate``, trace/parallel_tp.py ``_block_plan``), read off autocast's copy of that input (B·S·H) against
    the block's output (B·S/tp·H). The MLP's frame holds the gathered input (the residual stream's dtype) beside
    the norm's local output, and the rowwise down projection's output gradient arrives all-gathered (B·S·H in the
    product's dtype) before its node unpacks the saved tensor that starts the recomputation; its local shard was
    freed by then. Tiny Llama tp 2 --sp amp-bf16 --recompute full B2 S64: the step's top, 9,216 B over the MLP
    product's moment (trace: ``_to_copy`` in model.layers.0.mlp.down_proj), == the trace with it."""
    cast = next((i for i in mlp if i.name.endswith(".input_cast") and i.shape), None)
    if cast is None or not out.shape:
        return 1
    return max(1, math.prod(cast.shape) // math.prod(out.shape))


def adapter_down_moments(block: list[MemoryItem], acts: list[MemoryItem], unsaved: list[MemoryItem], *,
                         residual_bytes: int, checkpointed: bool) -> list[dict[str, int]]:
    """The stop (module docstring) at a LoRA-adapted down projection (peft ``lora.Linear.forward``: ``result =
    base_layer(x)``, then ``x = _cast_input_dtype(x, lora_A.weight.dtype)``, ``result + lora_B(lora_A(x)) *
    scaling``): its adapters' tensors are the block's last saved ones, so the recomputation stops at ``lora_B``'s
    saved weight copy (or weight), with the frozen base layer's output (``result``, the residual's shape in the
    product's dtype) and peft's copy of the product in the adapter's dtype (made when they differ: fp32 adapters
    under autocast) alive beside the MLP's input and the product. The adapter branch's gradient waits too: the
    ``* scaling`` node (``MulBackward0`` by a number saves nothing) runs before ``lora_B``'s, whose unpack starts
    the recomputation. Checkpointed or not, in one dtype, the down projection's input-gradient sum too
    (:func:`_adapter_down_input_sum`). [] for other layouts."""
    out = next((i for i in acts if i.name.endswith(".residual_mlp")), None)
    k = acts.index(out) if out is not None else 0
    down = acts[k - 1].name.split(".mlp.", 1)[-1].split(".", 1)[0] if k and ".mlp." in acts[k - 1].name else None
    if down is None or any(".mlp." in i.name and not i.name.split(".mlp.", 1)[1].startswith(f"{down}.")
                           for i in acts[k:]) or f".mlp.{down}.lora_A." not in acts[k - 1].name:
        return []
    marker = {i.name.split(".mlp.", 1)[1].split(".", 1)[0]: i for i in unsaved if ".mlp." in i.name
              and i.name.endswith(".input") and i.shape}
    prod = marker.get(down)
    adapter = next((i for i in block if i.category is Category.PARAMETER
                    and i.name.endswith(f".mlp.{down}.lora_A.default.weight")), None)
    if prod is None or adapter is None:
        return []
    # in one dtype (no autocast, nothing cast in the MLP) the adapters' lora_A save the MLP's input and the product
    # themselves (peft ``_cast_input_dtype`` returns x when its dtype is the adapter's): already among ``acts``
    one_dtype = not any(i.name.endswith("_cast") for i in acts if ".mlp." in i.name)
    x = next((_bytes(i) for name, i in marker.items() if name != down
              and not (one_dtype and any(f".mlp.{name}.lora_A." in a.name for a in acts))), 0)
    kept_prod = one_dtype and acts[k - 2].shape == prod.shape and not acts[k - 2].name.endswith("_cast")
    branch = residual_bytes * dtype_bytes(prod.dtype) // dtype_bytes(out.dtype)
    # peft's fp32 copy of the product: saved by lora_A itself without autocast (then among ``acts``)
    copy = int(math.prod(prod.shape) * dtype_bytes(adapter.dtype)) if adapter.dtype != prod.dtype and not any(
        f".mlp.{down}." in i.name and i.shape == prod.shape and i.dtype == adapter.dtype for i in acts) else 0
    stop = {"block_gradients": 0, "freed_activations": out.bytes, "after_attention": 0,
            "work": residual_bytes + (branch if prod.dtype != out.dtype else 0) + x + (0 if kept_prod else _bytes(prod))
            + branch + _adapter_branch_gradients(acts, adapter, prod, branch) + copy
            + (branch if _attention_output_held(acts) else 0)}
    promoted = adapter.dtype != prod.dtype and not any(i.name.endswith(".weight_cast") for i in acts)
    return [stop] * checkpointed + (_adapter_down_input_sum(block, acts[k - 2], acts[k - 1], out, down, residual_bytes)
                                    if kept_prod else []) + \
        ([_adapter_a_input_gradient(block, acts[k - 1], out, down, prod, adapter, branch, residual_bytes)]
         if promoted else [])


def _adapter_a_input_gradient(block: list[MemoryItem], lora_out: MemoryItem, out: MemoryItem, down: str,
                              prod: MemoryItem, adapter: MemoryItem, branch: int, residual_bytes: int) -> dict[str, int]:
    """A 16-bit base with fp32 adapters, no autocast (peft's ``result + lora_B(...) * scaling`` promoted to fp32): the
    end of the down projection's ``lora_A`` node (``MmBackward0``), which runs before the base layer's (the branch's
    nodes are the later ones). Alive beside the residual gradient: the base branch's gradient cast back to 16 bits
    (``validate_outputs``, torch/csrc/autograd/engine.cpp), waiting for the base layer's node; ``lora_A``'s output
    gradient (``lora_B``'s node made it and released its saved input, ``lora_A``'s output, while the ``* scaling``
    node's fp32 output was freed with it); ``lora_A``'s new input gradient, the product's shape in fp32 (its saved
    input, peft's fp32 copy of the product, not yet released); both adapters' weight gradients. Tiny GPT-NeoX bf16 B1
    S32, LoRA on every linear, eager: the step's top (trace: ``mm`` in ``dense_4h_to_h.lora_A``), 3,848 B under."""
    grads = sum(i.bytes for i in block if i.category is Category.GRADIENT and f".mlp.{down}.lora_" in i.name)
    wide = int(math.prod(prod.shape) * dtype_bytes(adapter.dtype))
    return {"block_gradients": grads, "freed_activations": out.bytes + lora_out.bytes, "after_attention": 0,
            "work": residual_bytes + branch + lora_out.bytes + wide}


def _adapter_branch_gradients(acts: list[MemoryItem], adapter: MemoryItem, prod: MemoryItem, branch: int) -> int:
    """What the down projection's ``result + lora_B(...) * scaling`` backward holds when ``lora_B``'s node unpacks:
    the ``* scaling`` node's output (the branch's gradient, in the adapters' dtype unless autocast ran them in the
    product's) and, where that sum was promoted (fp32 adapters on a 16-bit base, no autocast), the frozen base
    branch's gradient cast back to the product's dtype (``validate_outputs``, torch/csrc/autograd/engine.cpp)."""
    if any(i.name.endswith(".weight_cast") for i in acts) or adapter.dtype == prod.dtype:
        return branch
    return branch + branch * dtype_bytes(adapter.dtype) // dtype_bytes(prod.dtype)


def _adapter_down_input_sum(block: list[MemoryItem], prod: MemoryItem, lora_out: MemoryItem, out: MemoryItem,
                            down: str, residual_bytes: int) -> list[dict[str, int]]:
    """In one dtype, the sum of an adapted down projection's two input gradients (the product's): ``lora_A``'s
    ``MmBackward0`` ran first (the branch's nodes are the later ones in the graph), made its input gradient and
    released its saved input (the product itself) and ``lora_B``'s (``lora_A``'s output); then the frozen base
    layer's node made its own input gradient, and the product's input buffer sums the two into a new tensor
    (``InputBuffer::accumulate``, torch/csrc/autograd/input_buffer.cpp) while both are alive: three of the
    product's size beside the residual gradient, and the adapter's weight gradients made. Tiny Llama fp32 B1 S32,
    LoRA on q, v and the MLP, full recompute: the step's top (trace: ``add`` in ``down_proj.base_layer``)."""
    grads = sum(i.bytes for i in block if i.category is Category.GRADIENT and f".mlp.{down}.lora_" in i.name)
    return [{"block_gradients": grads, "freed_activations": out.bytes + prod.bytes + lora_out.bytes,
             "after_attention": 0, "work": residual_bytes + 3 * prod.bytes}]


#: the up projection whose adapted forward runs last before the MLP's down projection, by the MLP's layout (its
#: down projection): transformers ``LlamaMLP.forward`` (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: gate's
#: output and its activation are made first), ``GPTNeoXMLP.forward`` (one up projection)
_LAST_UP = {"down_proj": "up_proj", "dense_4h_to_h": "dense_h_to_4h"}


def adapter_up_forward(block: list[MemoryItem], acts: list[MemoryItem], unsaved: list[MemoryItem], *,
                       residual_bytes: int) -> list[dict[str, int]]:
    """Inside the recomputation of a 16-bit block whose adapters stay fp32 (peft's default upcast, no autocast), the
    last up projection's adapter forward (peft ``lora.Linear.forward``: ``result + lora_B(lora_A(x)) * scaling``):
    ``lora_B``'s fp32 (B, S, F) output and its scaled copy (``* scaling`` by a number) are alive together beside the
    frozen base layer's 16-bit output (``result``), the MLP's 16-bit input (cast to fp32 for the adapters, so not
    saved) and the decoder layer's ``residual`` local (a 16-bit RMSNorm saves its own fp32 copy of it). What started
    the recomputation waits too: the down projection's adapter node unpacked first (the ``* scaling`` node, which
    saves nothing, ran before it), so the block output's gradient, the base branch's gradient cast back to 16 bits
    (``validate_outputs``, torch/csrc/autograd/engine.cpp: the ``result + ...`` sum was fp32) and the adapter
    branch's fp32 gradient are held. Nothing of the up projection's output nor of the down projection is made yet.
    Tiny Llama bf16 B2 S64, LoRA on q, v and the MLP: the step's top (trace: ``mul`` in ``up_proj``). [] for other
    layouts, under autocast (``weight_cast`` copies) or when adapters and base share a dtype."""
    names = [i.name.split(".mlp.", 1)[-1] for i in acts if ".mlp." in i.name]
    down = next((d for d in _LAST_UP if f"{d}.lora_A.default.out" in names), None)
    up = _LAST_UP.get(down)
    adapter = next((i for i in block if i.category is Category.PARAMETER
                    and i.name.endswith(f".mlp.{up}.lora_A.default.weight")), None)
    marker = {i.name.split(".mlp.", 1)[1].split(".", 1)[0]: i for i in unsaved if ".mlp." in i.name
              and i.name.endswith(".input") and i.shape}
    if adapter is None or down not in marker or up not in marker or any(i.name.endswith(".weight_cast") for i in acts):
        return []
    prod, x = marker[down], marker[up]
    if adapter.dtype == prod.dtype or _bytes(x) != residual_bytes:
        return []
    lora_a = next(k for k, i in enumerate(acts) if i.name.endswith(f".mlp.{up}.lora_A.default.out"))
    # the up projection's output (saved by the product) and every tensor after it are not made yet
    unmade = next((k for k, i in enumerate(acts) if k > lora_a and f".mlp.{up}." in i.name), None)
    if unmade is None:
        return []
    wide = int(math.prod(prod.shape) * dtype_bytes(adapter.dtype))  # lora_B's output, (B, S, F) fp32
    # the layer's local across its MLP: a sequential block's ``residual`` (unless saved: ``residual_attn``), a
    # parallel one's attention output (``GPTNeoXLayer.forward``)
    held = residual_bytes if not any(i.name.endswith(".residual_attn") for i in acts) else 0
    branch = _bytes(x)
    return [{"block_gradients": 0, "freed_activations": sum(i.bytes for i in acts[unmade:]), "after_attention": 0,
             "work": residual_bytes + _adapter_branch_gradients(acts, adapter, prod, branch) + branch + held
             + _bytes(prod) + 2 * wide}]


#: blocks whose forward keeps the attention's output in a local to the end, beside the residual sum it made:
#: transformers ``GPT2Block.forward`` (``attn_output, _ = self.attn(...)``; ``hidden_states = attn_output +
#: residual``), keyed by the block's attention child. Llama's and Qwen2's layers rebind ``hidden_states``.
_FRAME_KEEPS_ATTENTION_OUTPUT = ("attn",)


def _attention_output_held(acts: list[MemoryItem]) -> bool:
    """Whether the block's attention output is alive through its MLP: a parallel-residual block's (no residual sum
    after the attention) or one whose forward keeps it in a local (:data:`_FRAME_KEEPS_ATTENTION_OUTPUT`)."""
    parallel = not any(i.name.endswith(".residual_attn") for i in acts) and any(
        f".{c}." in i.name for i in acts for c in ("attention", "self_attn", "attn"))
    return parallel or any(f".{c}." in i.name for i in acts for c in _FRAME_KEEPS_ATTENTION_OUTPUT)


def _bytes(item: MemoryItem) -> int:
    """A zero-byte marker's tensor size."""
    return int(math.prod(item.shape) * dtype_bytes(item.dtype))
