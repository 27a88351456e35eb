"""One rank of a real FSDP2 step, every storage it makes tagged with the stream current when it was
made: FSDP2 switches streams with ``device_handle.stream(...)``, which on CPU is ``torch.cpu.stream``
and sets what ``torch.cpu.current_stream()`` returns, so the stream of each allocation is read
exactly where a CUDA run would have made it.

Run by tests/parallel/test_fsdp_streams.py under torchrun (gloo, CPU):
``python fsdp_streams_worker.py OUT_DIR '<scenario json>'``. Each block and then the root are
``fully_shard``-ed (torchtitan's ``apply_fsdp`` at 9dec370, trainmem's ``--fsdp-units blocks``); two
steps warm up (optimizer state made, gradients freed by ``zero_grad(set_to_none=True)``); the third
step's forward and backward are tracked by a ``TorchDispatchMode`` over the live storages
(:mod:`trainmem.trace.storages`): ``("alloc", stream, op, nbytes)`` for each new storage an op outputs (``op``: the op that output
it), ``("free", stream, op, nbytes)`` when it dies, on the side streams only.
"""

from __future__ import annotations


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.storages import StorageTracker, dispatch_mode

    torch.manual_seed(0)
    model = build_hf_model(dict(sc["config"]), attention="sdpa", dtype=torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if sc["bf16"] \
        else MixedPrecisionPolicy()
    for unit in [*model.model.layers, model]:  # the blocks, then the root
        fully_shard(unit, mp_policy=mp)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    ids = torch.randint(0, sc["config"]["vocab_size"], (sc["batch"], sc["seq"]), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    warm_up = 2  # the optimizer state made, the gradients freed: the next step is a steady one
    while warm_up:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        warm_up -= 1
    ctx = model._get_fsdp_state()._fsdp_param_group.comm_ctx
    names = {id(ctx.all_gather_copy_in_stream): "all_gather_copy_in", id(ctx.all_gather_stream): "all_gather",
             id(ctx.reduce_scatter_stream): "reduce_scatter", id(ctx.all_reduce_stream): "all_reduce"}
    events: list[list] = []

    def freed(entry) -> None:
        if entry.data is not None and entry.data[0] != "default":
            events.append(["free", *entry.data, entry.nbytes])

    tracker = StorageTracker(on_free=freed)

    def after_op(func, tensors) -> None:
        for t in tensors:
            entry, new = tracker.add(t)
            if new:
                entry.data = (names.get(id(torch.cpu.current_stream()), "default"), str(func))
                if entry.data[0] != "default":
                    events.append(["alloc", *entry.data, entry.nbytes])

    with dispatch_mode(after_op):
        model(ids, labels=ids).loss.backward()
    tracker.close()
    return {"rank": dist.get_rank(), "events": events}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
