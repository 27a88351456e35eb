"""What torch's context parallelism (``--cp N --cp-style ring``) changes on a rank: its saved set, its ring's
buffers, and ``context_parallel``'s copies of the token ids.

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
  ranks modelled by the inventory (rank 0's).

The ring's own buffers live only inside each attention call (:func:`ring_forward_bytes`: the K/V copies,
``_AllGatherRotater``'s all-gathered K/V, ``torch.cat`` send buffers, ``_SDPAMerger``'s fp32 merge;
:func:`ring_backward_bytes`: fp32 accumulators for dq, dk, dv, the all-gathered K/V, the fp32 dK/dV send and
receive buffers of ``_AllToAllRotater``, each step's flash gradients beside the previous step's). They differ by
rank (the load balancing's half steps), so they are taken per rank class (:class:`RingBuffers`: the worst rank
keeping the copies, and the last rank, beside its smaller saved set): the phases are the worst rank's. Each is a
moment of its own (estimate/cp_ring_moments.py): the backward one a node moment of each block (the attention's
node runs after the output projection's and every later child's, so their saved tensors are gone), the forward
one inside the last block's attention, which tops the forward phase when the blocks keep little
(``--recompute full``). ``context_parallel`` holds copies of the caller's ids while it is open
(:func:`buffer_copies_bytes`), counted from forward to the end of backward.
Known limitation: the flash op's output layout is its meta kernel's (``torch/_meta_registrations.py``
``meta__scaled_dot_product_flash_attention``: ``empty_like(query)``), not a CUDA run's; for a transformers
Llama the query reaching SDPA is laid out (B, S, A, hd), as the CUDA kernel's output is, but this is unverified
on a GPU; so is the ring backward's count, which holds the flash backward's outputs only (its meta kernel's:
a CUDA kernel's own workspace is not seen), and K/V with as many heads as q (the stand-in takes no
``enable_gqa``: GQA's K/V at Akv heads through the ring are modelled, not run).
The ring's K/V width is the model's: transformers passes Akv heads to SDPA (``enable_gqa``), torchtitan's Llama
repeats them to the query heads first (``repeat_kv``, torchtitan/models/llama/model.py), so at a 405B TP rank
(tp 8) the ring carries 16 K/V heads, not 1: backward 4,992 MiB at cp 8 where the hf profile counts 833
(measured with torch's ring at that shape: tests/parallel/test_cp_405b_rank.py). Not expressible under the hf profile.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ring_merged_copy", "ring_backward_bytes", "ring_forward_bytes", "buffer_copies_bytes", "RingBuffers",
           "ring_buffers", "ring_as_node_moment"]


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


def ring_forward_bytes(*, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, cp: int, rank: int,
                       act_bytes: int, kv_contiguous: bool = False) -> int:
    """The most bytes torch's ring attention forward allocates above its inputs on rank ``rank`` of ``cp``
    (``seq``: the rank's S/cp), following ``_templated_ring_attention`` and ``_SDPAMerger``
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py) with its defaults (outputs merged
    in fp32, head-tail load balancing, K/V all-gathered once by ``_AllGatherRotater``) and a causal mask; the
    flash op's philox seed and offset are left out (host tensors on CUDA without dropout)."""
    q, kv = batch * heads * seq * head_dim, batch * kv_heads * seq * head_dim  # elements
    rows = batch * heads * seq  # the log-sum-exp's
    f = _Frame()
    if not kv_contiguous:  # key.contiguous(), value.contiguous()
        f.new(act_bytes * kv, "key")
        f.new(act_bytes * kv, "value")
    for i in range(cp):
        if i > 0:  # rotater.next_buffer(): views of the gathered K/V
            f.alias("gathered", "key", "value")
        if i < cp - 1:  # torch.cat([key.flatten(), value.flatten()]), handed to the rotater, then dropped
            f.new(2 * act_bytes * kv, "next_kv")
            if i == 0:
                f.new(cp * 2 * act_bytes * kv, "gathered")  # all_gather_single's output, kept by the rotater
            f.drop("next_kv")
        f.alias("key", "k")  # the op's arguments (q, k, v: K/V or their first halves, views) hold the previous
        f.alias("value", "v")  # step's K/V copies until here
        half = i > rank  # load balancing: the second half of q attends the whole K/V chunk (partial)
        q_rows = q // 2 if half else q
        lse_rows = rows // 2 if half else rows
        f.new(act_bytes * q_rows, "new_out")  # the op's output and log-sum-exp, then bound to out, logsumexp
        f.new(4 * lse_rows, "new_lse")
        f.alias("new_out", "out")
        f.alias("new_lse", "logsumexp")
        f.drop("new_out", "new_lse")
        # _SDPAMerger.step: out.to(float32) (a copy unless fp32 already), lse already fp32
        if act_bytes == 4:
            f.alias("out", "block_out")
        else:
            f.new(4 * q_rows, "block_out")
        if i == 0:  # the merger keeps the first step's output and log-sum-exp
            f.alias("block_out", "m_out")
            f.alias("logsumexp", "m_lse")
            f.drop("block_out")
            continue
        # _merge_one: out - sigmoid(block_lse - lse) * (out - block_out); lse - logsigmoid(lse - block_lse)
        f.new(4 * lse_rows, "t")
        f.new(4 * lse_rows, "sig")
        f.drop("t")
        f.new(4 * q_rows, "diff")
        f.new(4 * q_rows, "prod")
        f.drop("sig", "diff")
        f.new(4 * q_rows, "merged_out")
        f.drop("prod")
        f.new(4 * lse_rows, "t")
        f.new(4 * lse_rows, "logsig")
        f.drop("t")
        f.new(4 * lse_rows, "merged_lse")
        f.drop("logsig")
        if half:  # _partial_update: torch.cat of the kept first half and the merged second half
            f.new(4 * rows, "m_lse")
            f.new(4 * q, "m_out")
        else:
            f.alias("merged_lse", "m_lse")
            f.alias("merged_out", "m_out")
        f.drop("merged_out", "merged_lse", "block_out")
    # results(): the merged output back in the inputs' dtype (a view if fp32), the log-sum-exp as it is
    if act_bytes != 4:
        f.new(act_bytes * q, "result")
    return f.peak


_IDS = "cp_buffer_copies"  # context_parallel's copies of the caller's token ids (:func:`buffer_copies_bytes`)


def buffer_copies_bytes(*, batch: int, seq: int, cp: int) -> int:
    """What ``context_parallel`` (torch/distributed/tensor/experimental/_context_parallel/_attention.py) holds
    of the caller's (B, S) int64 token ids (its one buffer, also the labels, restored at exit) while the
    context is open (forward and backward, not the optimizer step): the restore copy (``b.clone()``, B·S·8),
    the sharded buffers it keeps in its frame (``shards``, and ``shard.clone()`` of the last one: 2·B·(S/cp)·8),
    and the ids' own storage beyond the rank's chunk (``buffer.resize_(shard.shape)`` keeps the storage:
    B·(S − S/cp)·8 beyond the embedding's indices, counted at B·(S/cp)·8). Measured (cp_flash_standin.py,
    B 1, S 64, cp 2): 1,280 B. torchtitan passes its inputs and labels as ``no_restore_buffers`` (no copy
    then) and the RoPE table as a third buffer: not modelled."""
    local = seq // cp
    return 8 * batch * (seq + 2 * local + seq - local)


_RING = "cp_ring_backward"  # the working buffer's name (estimate/parallel_buffers.py)


@dataclass(frozen=True, kw_only=True)
class RingBuffers:
    """The ring's most bytes above its inputs, backward and forward, per rank class: the worst of the ranks
    that keep the merged output's copy (0 to cp - 2: :func:`ring_merged_copy`), and the last rank."""

    backward: tuple[int, int]
    forward: tuple[int, int]

    def __post_init__(self) -> None:
        if any(b < 0 for b in (*self.backward, *self.forward)):
            raise ValueError(f"RingBuffers: negative bytes: backward={self.backward}, forward={self.forward}")


def ring_buffers(local, local_step, par, act_bytes: int) -> RingBuffers:
    """:func:`ring_backward_bytes` and :func:`ring_forward_bytes` per rank class (``local``, ``local_step``:
    the TP-local model and the CP-local step). They differ by rank: tiny Llama bf16 cp 2, backward 104,704 B on
    rank 0 and 106,496 on rank 1, fp32 151,808 and 147,456 (the load balancing's half steps fall on other ring
    steps)."""
    kw = dict(batch=local_step.batch, heads=local.num_heads, kv_heads=local.num_kv_heads, seq=local_step.seq,
              head_dim=local.head_dim, cp=par.cp, act_bytes=act_bytes)

    def classes(fn) -> tuple[int, int]:
        return max(fn(rank=r, **kw) for r in range(par.cp - 1)), fn(rank=par.cp - 1, **kw)

    return RingBuffers(backward=classes(ring_backward_bytes), forward=classes(ring_forward_bytes))


def ring_as_node_moment(working: dict[str, dict[str, int]], local, local_step, par, act_bytes: int, *,
                        taken: bool) -> RingBuffers | None:
    """Move the ring's backward buffers out of the ``backward`` working set, to ride the attention's node
    moments (estimate/cp_ring_moments.py), where they are the only backward buffers beside
    ``context_parallel``'s copies of the ids (:func:`buffer_copies_bytes`; otherwise the block's node moments
    are off, peak.py ``node_moments_off``, and the ring stays on the generic last-block moment, an upper bound:
    what holds beside it is not modelled there). ``taken``: the node moments can be read (the estimate's own
    inventory, no gradient stepped in backward). Checked with CP beside data parallel ranks only: under TP or a
    pipeline the block's other node moments are not (peak.py takes them all at once), so the ring stays put.
    Returns :func:`ring_buffers`, or ``None`` where nothing moved."""
    back = working.get("backward", {})
    if not taken or par.tp > 1 or par.pp > 1 or _RING not in back or set(back) - {_RING, _IDS}:
        return None
    back.pop(_RING)
    return ring_buffers(local, local_step, par, act_bytes)
