"""One rank of a real FSDP2 step under ``CPUOffloadPolicy``, its live storages sorted by kind.

Run by tests/parallel/test_fsdp_cpu_offload.py under torchrun (gloo, CPU):
``python fsdp_offload_worker.py OUT_DIR '<scenario json>'``. Every block and the root are
``fully_shard``-ed with ``offload_policy=CPUOffloadPolicy(pin_memory=False)`` (pinning needs an
accelerator), as torchtune's ``shard_model(cpu_offload=True)`` and torchtitan's ``apply_fsdp``
do; three AdamW (foreach) steps run and the third is tracked with
:class:`trainmem.measure_dist.tracking.LiveTracker`.

On a CPU "device" the host and the device are the same memory, so each live storage is told apart
by what FSDP holds it as, read off the FSDP state after every op (torch 2.13,
torch/distributed/fsdp/_fully_shard/):

* host kinds (``FSDPParam.sharded_param`` and its ``.grad``, the optimizer's state): what CPU
  offload keeps on the host;
* ``gathered``: ``FSDPParam.all_gather_outputs`` (the unsharded parameters) and the flat
  all-gather buffers still held (``FSDPParamGroup._all_gather_result``, prefetched, and
  ``comm_ctx.all_gather_state``, whose free is deferred to the next all-gather);
* ``grad_buffers``: the unsharded gradients (``FSDPParam.unsharded_param.grad``) and the
  reduce-scatter inputs kept in ``comm_ctx.reduce_scatter_states``;
* ``saved`` (autograd's saved activations) and ``other`` (temporaries, logits, their gradients);
* ``host_rng_states``: the CPU generator states a compiled checkpointed block saves for its
  recomputed SDPA (host memory on a GPU as well: ``torch.cuda.get_rng_state()`` is a host tensor).

A fourth step runs under torchtune's activation offload policy (trainmem/trace/offload.py), which
torchtune's distributed recipe puts around the sharded model's forward: what it leaves on the
device and what it copies to the host.

Scenario ``compile: "partition"`` (torchtune's ``compile=True`` with ``fsdp_cpu_offload``): each
decoder layer ``torch.compile``-d with trainmem's partitioning backend
(measure_dist/worker.py ``_compile_blocks``; its regions' saved values come back as
``compiled_regions``), after ``recompute: "full"`` put transformers' non-reentrant checkpoint in
each layer (trace/recompute.py ``enable_recompute``: the checkpoint runs inside the compiled
region, as torchtune's ``compile_model`` before ``set_activation_checkpointing`` leaves it). The
activation offload step is skipped there (not composed with compile under FSDP).
"""

from __future__ import annotations


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from trainmem.measure_dist.tracking import LiveTracker, fsdp_unsharded_tensors, local
    from trainmem.models.hf import build_hf_model

    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = dict(sc["config"])
    model = build_hf_model(cfg, attention="sdpa", dtype=torch.float32)
    if sc.get("recompute", "none") != "none":
        from trainmem.specs import ImplSpec
        from trainmem.trace.recompute import enable_recompute

        enable_recompute(model, ImplSpec(device="cpu", attention="sdpa", recompute=sc["recompute"]))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if sc.get("bf16") else MixedPrecisionPolicy())
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False), mp_policy=mp)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    regions = []
    if sc.get("compile"):
        from trainmem.measure_dist.worker import _compile_blocks

        torch._dynamo.reset()  # each scenario's model compiles afresh (no earlier scenario's cache or recompile limit)
        regions = _compile_blocks(model, sc["compile"])
    B, S, V = sc["batch"], sc["seq"], cfg["vocab_size"]
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1000 + rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def forward_backward():
        model(ids, labels=ids).loss.backward()

    for _ in range(2):
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]
    fps = [fp for g in groups for fp in g.fsdp_params]
    ctx = groups[0].comm_ctx

    def key(t) -> int:
        return local(t).untyped_storage()._cdata

    def kinds_now(tracker) -> dict[str, set[int]]:
        sharded = [fp.sharded_param for fp in fps]
        gathered = {key(t) for t in unsharded}
        for g in groups:
            if g._all_gather_result is not None:
                gathered.add(key(g._all_gather_result.all_gather_output))
        if ctx.all_gather_state is not None:
            gathered.add(key(ctx.all_gather_state.all_gather_result.all_gather_output))
        grad_buffers = {key(s.reduce_scatter_input) for s in ctx.reduce_scatter_states}
        for fp in fps:
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                grad_buffers.add(key(up.grad))
        host = {"host_params": {key(p) for p in sharded},
                "host_grads": {key(p.grad) for p in sharded if p.grad is not None},
                "host_optimizer": {key(v) for st in opt.state.values() for v in st.values()}}
        out = {**host, "gathered": gathered - host["host_params"], "grad_buffers": grad_buffers - host["host_grads"],
               "host_rng_states": tracker.rng_states & tracker._saved}
        taken = set().union(*out.values())
        out["saved"] = tracker._saved - taken
        return out

    class KindTracker(LiveTracker):
        """Per phase, the most bytes of each kind, and the kinds at the most device bytes."""

        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.most: dict[str, dict[str, int]] = {}
            self.at_device_peak: dict[str, dict[str, int]] = {}
            self.rng_states: set[int] = set()

        def _pack(self, t):
            # a compiled checkpointed block's generator state (functionalize_rng_ops saves torch.get_rng_state():
            # host memory on a GPU too, estimate/activation_offload.py CPU_GENERATOR_STATE_BYTES)
            if t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1:
                self.rng_states.add(key(t))
            return super()._pack(t)

        def _sample(self, op: str = "") -> None:
            super()._sample(op)
            if "_log_softmax_backward" in op:
                self.phase = "backward"
            entries = self.storages.entries
            kinds = {k: sum(entries[s].nbytes for s in keys if s in entries) for k, keys in kinds_now(self).items()}
            total = self.storages.live_bytes
            kinds["other"] = total - sum(kinds.values())
            kinds["device"] = total - sum(v for k, v in kinds.items() if k.startswith("host_"))
            most = self.most.setdefault(self.phase, {})
            for k, v in kinds.items():
                most[k] = max(most.get(k, 0), v)
            if kinds["device"] >= self.at_device_peak.get(self.phase, {}).get("device", -1):
                self.at_device_peak[self.phase] = {**kinds, "op": op}

    unsharded = fsdp_unsharded_tensors(model)
    tracker = KindTracker()
    for ts in (model.parameters(), model.buffers(), (v for st in opt.state.values() for v in st.values()),
               unsharded):
        tracker.watch(ts)
    with tracker:
        forward_backward()
        tracker.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
    # gloo's worker thread can hold a finished all-gather's output a moment past FSDP's last reference
    # (ProcessGroupGloo.cpp runLoop), which only adds bytes: the least of three offloaded steps, as the op-boundary
    # peaks of the other real tests take the least of several tracked steps
    kept, moved = (None, None) if sc.get("compile") else min(
        _activation_offload(model, ids, unsharded, fps, ctx, key) for _ in range(3))
    return {"rank": rank, "compiled_regions": regions, "act_offload_kept": kept, "act_offload_host": moved, "most": tracker.most, "at_device_peak": tracker.at_device_peak,
            "peak_bytes": tracker.peak_bytes,
            # AdamW's 0-dim step counters are CPU tensors with or without offload: left out
            "host_optimizer_bytes": sum(local(v).untyped_storage().nbytes() for st in opt.state.values()
                                        for v in st.values() if local(v).dim() > 0),
            "on_cpu": all(local(fp.sharded_param).device.type == "cpu" for fp in fps)}


def _activation_offload(model, ids, unsharded, fps, ctx, key) -> tuple[int, int]:
    """One more forward + loss + backward under torchtune's activation offload policy
    (trainmem/trace/offload.py, ``use_streams=False``), as torchtune's distributed recipe wraps the
    forward of the sharded model: (bytes the forward leaves on the device besides FSDP's own
    storages, plus the input ids the embedding keeps; device storages copied to the host)."""
    from trainmem.trace.live import LiveStorages
    from trainmem.trace.offload import offload_activations

    skip = {key(t) for t in (*model.parameters(), *model.buffers(), *unsharded, ids)}
    skip |= {key(fp.sharded_param) for fp in fps}
    with offload_activations(model, use_streams=False) as off:
        with LiveStorages(skip_keys=skip) as live:
            loss = model(ids, labels=ids).loss
        # the last block's flat all-gather buffer, whose free FSDP defers to the next all-gather
        held = ctx.all_gather_state.all_gather_result.all_gather_output if ctx.all_gather_state else None
        held_bytes = held.untyped_storage().nbytes() if held is not None and live.storages.get(held) else 0
        # the loss the caller holds stays in: the estimate's loss.value
        kept = live.now - held_bytes + ids.untyped_storage().nbytes()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return kept, off.offloaded_storage_bytes


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
