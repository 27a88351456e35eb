"""One rank of a real FSDP2 step with the token embedding and the output layer as their own
``fully_shard`` units (torchtune's ``custom_sharded_layers: ['tok_embeddings', 'output']``,
torchtune/training/_distributed.py ``shard_model``; torchtitan's ``apply_fsdp``), its gathered
parameters per phase.

Run by tests/parallel/test_fsdp_units.py under torchrun (gloo, CPU):
``python fsdp_units_worker.py OUT_DIR '<scenario json>'``. ``embed_tokens``, ``[norm, lm_head]`` (as torchtitan groups them; and,
with ``units='blocks'``, neither), every block and the root are ``fully_shard``-ed with
``CPUOffloadPolicy(pin_memory=False)``, so the sharded parameters are told apart from the gathered
ones as in tests/parallel/fsdp_offload_worker.py: ``gathered`` is every ``FSDPParam``'s
``all_gather_outputs`` plus the flat all-gather buffers still held (``FSDPParamGroup._all_gather_result``
and ``comm_ctx.all_gather_state``), summed over live storages after every op of the third step.
"""

from __future__ import annotations


def _sharded_model(sc: dict):
    """The tiny Llama, ``fully_shard``-ed unit by unit, then at the root."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from trainmem.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(dict(sc["config"]), attention="sdpa", dtype=torch.float32)
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if sc.get("bf16") else {}
    inner = model.model
    units = [*inner.layers]
    if sc["units"] != "blocks":  # torchtitan: tok_embeddings, each block, [norm, output]
        units = [inner.embed_tokens, *units, [inner.norm, model.lm_head]]
    for unit in [*units, model]:
        fully_shard(unit, offload_policy=CPUOffloadPolicy(pin_memory=False), mp_policy=MixedPrecisionPolicy(**bf16))
    return model


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist

    from trainmem.measure_dist.tracking import LiveTracker, fsdp_unsharded_tensors, local

    model = _sharded_model(sc)
    V = sc["config"]["vocab_size"]
    seed = torch.Generator().manual_seed(1000 + dist.get_rank())
    ids = torch.randint(0, V, (sc["batch"], sc["seq"]), generator=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def forward_backward():
        model(ids, labels=ids).loss.backward()

    for _ in range(2):  # the third step is tracked, with every lazy state made
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]
    ctx = groups[0].comm_ctx

    def key(t) -> int:
        return local(t).untyped_storage()._cdata

    sharded = {key(fp.sharded_param) for g in groups for fp in g.fsdp_params}

    def gathered_now() -> set[int]:
        out = {key(t) for t in unsharded}
        for g in groups:
            if g._all_gather_result is not None:
                out.add(key(g._all_gather_result.all_gather_output))
        if ctx.all_gather_state is not None:
            out.add(key(ctx.all_gather_state.all_gather_result.all_gather_output))
        return out - sharded

    class GatherTracker(LiveTracker):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.most: dict[str, int] = {}
            self.at: dict[str, str] = {}

        def _sample(self, op: str = "") -> None:
            super()._sample(op)
            if "_log_softmax_backward" in op:
                self.phase = "backward"
            entries = self.storages.entries
            g = sum(entries[s].nbytes for s in gathered_now() if s in entries)
            if g > self.most.get(self.phase, -1):
                self.most[self.phase], self.at[self.phase] = g, op

    unsharded = fsdp_unsharded_tensors(model)
    tracker = GatherTracker()
    for ts in (model.parameters(), model.buffers(), (v for st in opt.state.values() for v in st.values()),
               unsharded):
        tracker.watch(ts)
    with tracker:
        forward_backward()
    return {"rank": dist.get_rank(), "most": tracker.most, "at": tracker.at}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
