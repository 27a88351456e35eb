"""One rank of a real FSDP1 step as HF Trainer + accelerate run peft LoRA (fms-acceleration's
benchmarks: scripts/benchmarks/accelerate.yaml, FULL_SHARD, BACKWARD_PRE, no mixed precision).

Run by tests/parallel/test_fsdp1_peft.py under torchrun (gloo, CPU):
``python fsdp1_peft_worker.py OUT_DIR '<scenarios json>'``. The model is wrapped with the keyword
arguments ``Accelerator.prepare_model`` passes to ``FullyShardedDataParallel`` (accelerate/accelerator.py,
FSDP1 branch): ``use_orig_params=True`` (``accelerate launch``'s ``--fsdp_use_orig_params`` default),
``limit_all_gathers=True``, ``backward_prefetch=BACKWARD_PRE``, ``forward_prefetch=False``,
no ``mixed_precision`` (``sync_module_states=True`` only broadcasts rank 0's weights at wrap
time and refuses CPU modules; every rank here builds the same weights from one seed); with
``wrap='peft'`` the auto-wrap policy is peft's ``fsdp_auto_wrap_policy`` (peft/utils/other.py),
which HF Trainer installs for a LoRA model
(transformers ``Trainer._fsdp_qlora_plugin_updates``, 5.x ``update_fsdp_plugin_peft``): every
decoder layer and, separately, every leaf module whose weight trains (each ``lora_A``/``lora_B``).
``shard_grad_op=True``: SHARD_GRAD_OP (no reshard after forward). ``wrap='blocks'``: decoder
layers only; ``wrap='none'``: no FSDP (run it on one process), the same step for comparison.

``checkpoint='hf'``: ``gradient_checkpointing_enable()`` before wrapping, as HF Trainer does: in
transformers 5.x each decoder layer is a ``GradientCheckpointingLayer`` that checkpoints its own
forward (non-reentrant by default), so the checkpoint runs *inside* the FSDP unit.
``checkpoint='outside'``: as transformers 4.48 ran it (``self._gradient_checkpointing_func(
decoder_layer.__call__, ...)`` in the model's layer loop, around the FSDP wrapper,
``use_reentrant=True`` by default), with the embedding output made to require grad
(``enable_input_require_grads``, as TRL's SFTTrainer does for reentrant checkpointing).

Measured on the third step (AdamW foreach): each ledger by storage, and after every op the live
bytes with the gathered flat parameters (``FlatParamHandle``'s padded unsharded flat parameter,
allocated and freed by resizing its storage, so watched and re-read) and the FlatParameters'
unsharded gradients, per phase (forward until the loss backward, then backward).
"""

from __future__ import annotations


def _policy(model, wrap: str):
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if wrap == "peft":
        from peft.utils.other import fsdp_auto_wrap_policy

        return fsdp_auto_wrap_policy(model)
    block = type(next(m for n, m in model.named_modules() if n.endswith("layers.0")))
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})


def _checkpointed(layers) -> None:
    """transformers 4.48's reentrant checkpoint around each (FSDP-wrapped) decoder layer call."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, position_embeddings=None, **kw):
            cos, sin = position_embeddings

            def run(h, c, s):
                return self.inner(h, position_embeddings=(c, s), **kw)

            return checkpoint(run, hidden_states, cos, sin, use_reentrant=True)

    for i in range(len(layers)):
        layers[i] = Ckpt(layers[i])


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, ShardingStrategy

    from trainmem.measure_dist.tracking import LiveTracker, storage_bytes
    from trainmem.models.hf import build_hf_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sc["precision"]]
    torch.manual_seed(0)
    model = build_hf_model(dict(sc["config"]), attention="sdpa", dtype=dtype)
    for name, p in model.named_parameters():
        if any(f in name for f in sc.get("freeze", ())):
            p.requires_grad_(False)
    if sc.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=sc["lora_rank"], lora_alpha=sc["lora_rank"],
                                                 target_modules=sc["lora_targets"]))
    if sc.get("checkpoint") == "hf":  # transformers 5.x: inside each decoder layer, non-reentrant
        model.gradient_checkpointing_enable()
    elif sc.get("checkpoint") == "outside":
        model.enable_input_require_grads()
    net = model if sc["wrap"] == "none" else FSDP(  # "none": the same step without FSDP (one process)
        model, auto_wrap_policy=_policy(model, sc["wrap"]),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP if sc.get("shard_grad_op") else ShardingStrategy.FULL_SHARD,
        use_orig_params=True, limit_all_gathers=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=False, device_id=torch.device("cpu"))
    if sc.get("checkpoint") == "outside":
        inner = next(m for m in net.modules() if hasattr(m, "layers") and isinstance(m.layers, torch.nn.ModuleList))
        _checkpointed(inner.layers)
    V = sc["config"]["vocab_size"]
    ids = torch.randint(0, V, (sc["batch"], sc["seq"]), generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    handles = [m._handle for m in FSDP.fsdp_modules(net) if m._handle is not None]

    def step():
        net(ids, labels=ids).loss.backward()
        flat_grads = storage_bytes(h.flat_param.grad for h in handles)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return flat_grads

    step()
    step()
    dist.barrier()
    padded = [h.flat_param._full_param_padded for h in handles]  # made by the first forward's lazy init

    def opt_tensors():
        return (v for st in opt.state.values() for v in st.values() if v.dim() > 0)

    def keys(ts) -> set[int]:
        return {t.untyped_storage()._cdata for t in ts if t is not None}

    class Tracker(LiveTracker):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.most: dict[str, dict] = {}

        def _sample(self, op: str = "") -> None:
            super()._sample(op)
            e = self.storages.entries
            total = self.storages.live_bytes
            gathered = sum(e[k].nbytes for k in keys(padded) if k in e)
            if "_log_softmax_backward" in op and self.phase == "forward":
                self.phase = "backward"
                self.at_loss_backward = {"total": total, "gathered": gathered}
            grads = sum(e[k].nbytes for k in keys(g for h in handles for g in (
                h.flat_param.grad, getattr(h.flat_param, "_saved_grad_shard", None))) if k in e)
            most = self.most.setdefault(self.phase, {"total": -1, "most_gathered": 0})
            most["most_gathered"] = max(most["most_gathered"], gathered)
            if total > most["total"]:
                most.update(total=total, gathered=gathered, flat_grads=grads, op=op)

    tracker = Tracker()
    # the caller's token ids are alive all step (a frozen embedding saves none of them: estimate/phase_parts.py caller_ids)
    for ts in (net.parameters(), net.buffers(), opt_tensors(), padded,
               (h.flat_param._local_shard for h in handles), [ids]):
        tracker.watch(ts)
    baseline = tracker.current_bytes()
    with tracker:
        flat_grads = step()
    states = {"parameter": storage_bytes(h.flat_param._local_shard for h in handles) if handles
              else storage_bytes(net.parameters()),
              "optimizer_state": storage_bytes(opt_tensors()),
              "flat_gradient": flat_grads}
    return {"rank": dist.get_rank(), "states_bytes": states, "baseline_bytes": baseline,
            "peak_bytes": tracker.peak_bytes, "peak_op": tracker.peak_op, "most": tracker.most,
            "at_loss_backward": tracker.at_loss_backward, "peak_parts": tracker.peak_parts,
            "units": [list(h.flat_param._fqns) for h in handles],
            "flat_numels": [[h.flat_param._unpadded_unsharded_size.numel(), h.flat_param._padded_unsharded_size.numel(),
                             str(h.flat_param.dtype), bool(h.flat_param.requires_grad)] for h in handles]}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
