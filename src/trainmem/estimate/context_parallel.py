"""What torch's context parallelism (``--cp N --cp-style ring``) changes in a rank's saved set.

Measured on fake tensors with torch's own ``context_parallel`` (ring, all-gather rotation, head-tail load
balancing; ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) and CUDA's flash op
standing in for SDPA (tests/parallel/cp_flash_standin.py, tests/parallel/test_cp_saved_set.py). Each rank keeps
one device's saved set at S/cp (the flash op's q, k, v, output and log-sum-exp are the rank's local chunks: the
ring's rotated K/V and partial outputs live only inside the attention call), and one more tensor per attention
layer on every rank but the last:

* ``_templated_ring_attention`` merges each ring step's output with ``_SDPAMerger``; a step where the rank's
  second query chunk alone attends (load balancing, ``i > rank``: every rank but the last has one) goes through
  ``_partial_update``, whose ``torch.cat`` returns a (B, A, S/cp, hd)-contiguous merged output, where the flash
  kernel's own output is laid out (B, S, A, hd). transformers' ``sdpa_attention_forward`` then copies it in
  ``attn_output.transpose(1, 2).contiguous()``, and ``o_proj`` keeps that copy: B·(S/cp)·A·hd elements.
  The last rank only adds in place of a whole step (``i <= rank``), the merged output keeps the kernel's layout
  and the transpose is a view, as on one device: it keeps B·(S/cp)·A·hd fewer elements per layer than the
  ranks modelled here (the estimate reports rank 0, the worst).

The ring's own buffers live only inside each attention call (``_AllGatherRotater``'s all-gathered K/V,
``torch.cat`` send buffers, the fp32 merge). Its backward (:func:`ring_backward_bytes`: fp32 accumulators for
dq, dk, dv, the all-gathered K/V, the fp32 dK/dV send and receive buffers of ``_AllToAllRotater``, each step's
flash gradients beside the previous step's) is counted at the last block's backward
(estimate/parallel_buffers.py), rank 0's; its forward's are gone by the end of forward, the phase the estimate
reads, and are not counted (measured there: tests/parallel/test_cp_ring_backward.py).

Known limitation: the flash op's output layout is its meta kernel's (``torch/_meta_registrations.py``
``meta__scaled_dot_product_flash_attention``: ``empty_like(query)``), not a CUDA run's; for a transformers
Llama the query reaching SDPA is laid out (B, S, A, hd), as the CUDA kernel's output is, but this is unverified
on a GPU; so is the ring backward's count, which holds the flash backward's outputs only (its meta kernel's:
a CUDA kernel's own workspace is not seen), and K/V with as many heads as q (the stand-in takes no
``enable_gqa``: GQA's K/V at Akv heads through the ring are modelled, not run).
"""

from __future__ import annotations

__all__ = ["ring_merged_copy", "ring_backward_bytes"]


def ring_merged_copy(ctx) -> bool:
    """Whether ``o_proj``'s input is a copy of the merged attention output (module docstring): torch's
    load-balanced ring (``--cp-style ring``) on the worst rank."""
    return ctx.shard.cp > 1 and ctx.shard.cp_style == "ring"


class _Frame:
    """A function frame's variables bound to buffers: a buffer is freed when no variable holds it (CPython's
    reference counting, which is what frees a tensor's storage mid-function); ``live`` and ``peak`` in bytes."""

    def __init__(self) -> None:
        self._vars: dict[str, int] = {}
        self._bytes: dict[int, int] = {}
        self.live = self.peak = 0

    def new(self, nbytes: int, *names: str) -> None:
        """A fresh buffer bound to ``names`` (allocated before the names drop what they held)."""
        key = len(self._bytes) + 1
        self._bytes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.bind(key, *names)

    def alias(self, source: str, *names: str) -> None:
        """``names`` become views of ``source``'s buffer."""
        self.bind(self._vars[source], *names)

    def drop(self, *names: str) -> None:
        self.bind(None, *names)

    def bind(self, key: int | None, *names: str) -> None:
        old = [self._vars.pop(n) for n in names if n in self._vars]
        if key is not None:
            self._vars.update(dict.fromkeys(names, key))
        for k in set(old) - set(self._vars.values()):
            self.live -= self._bytes[k]


def ring_backward_bytes(*, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, cp: int, rank: int,
                        act_bytes: int, kv_contiguous: bool = False) -> int:
    """The most bytes torch's ring attention backward allocates above its inputs on rank ``rank`` of ``cp``
    (``seq``: the rank's S/cp), following ``_templated_ring_attention_backward``
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py) with its defaults (fp32
    accumulation, head-tail load balancing, K/V all-gathered once by ``_AllGatherRotater``, K/V gradients
    passed on by ``_AllToAllRotater``) and a causal mask. ``kv_contiguous``: the saved K/V are already
    (B, Akv, S, hd)-contiguous (transformers' are transposed views: ``key.contiguous()`` copies them)."""
    q, kv = batch * heads * seq * head_dim, batch * kv_heads * seq * head_dim  # elements
    f = _Frame()
    f.new(4 * q, "grad_query")  # torch.zeros_like(..., dtype=float32)
    f.new(4 * kv, "grad_key")
    f.new(4 * kv, "grad_value")
    if not kv_contiguous:
        f.new(act_bytes * kv, "key")
        f.new(act_bytes * kv, "value")
    for i in range(cp):
        if i > 0:  # kv_rotater.next_buffer(): a chunk of the gathered K/V, a view
            f.alias("gathered", "key", "value")
        if i != cp - 1:
            f.new(2 * act_bytes * kv, "next_kv")  # torch.cat([key.flatten(), value.flatten()])
            if i == 0:  # all_gather_single once, its output kept by the rotater
                f.new(cp * 2 * act_bytes * kv, "gathered")
        half = i > rank  # load balancing: the second half of q attends the whole K/V chunk
        # the op's inputs bound to q, k, v, lse (out_ and dout are views of the saved output and its gradient)
        f.alias("key", "k")
        f.alias("value", "v")
        if half:
            f.new(4 * batch * heads * seq // 2, "lse")  # logsumexp.chunk(2)[1].contiguous()
        # the flash backward's dq, dk, dv, in the inputs' dtype, before the previous step's are released
        q_rows = q // 2 if half else q
        kv_rows = kv // 2 if 0 < i <= rank else kv
        f.new(act_bytes * q_rows, "new_dq")
        f.new(act_bytes * kv_rows, "new_dk")
        f.new(act_bytes * kv_rows, "new_dv")
        f.alias("new_dq", "dq_")
        f.alias("new_dk", "dk_")
        f.alias("new_dv", "dv_")
        f.drop("new_dq", "new_dk", "new_dv")
        if i > 0:  # dkv_rotater.next_buffer(): the K/V gradients received, views of the all-to-all output
            f.alias("received", "next_grad_kv", "grad_key", "grad_value")
            if i <= rank:  # _partial_update: torch.cat of the chunks, one half added in place
                f.new(4 * kv, "grad_key")
                f.new(4 * kv, "grad_value")
        f.new(8 * kv, "next_grad_kv")  # torch.cat of the fp32 K and V gradients
        f.new(8 * kv, "received")  # permute_tensor's all_to_all_single output, held by the rotater
        if i > rank:  # _partial_update of grad_query: torch.cat
            f.new(4 * q, "grad_query")
    f.new(act_bytes * q, "dq_out")  # grad_query.to(query.dtype)
    f.new(2 * act_bytes * kv, "next_grad_kv")  # the last received K/V gradients .to(key.dtype)
    return f.peak
