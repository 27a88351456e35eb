"""One rank of a real DTensor TP step (gloo, CPU) whose blocks are checkpointed and then compiled, as torchtitan
applies them (``apply_tp``, ``apply_ac``: ``checkpoint_wrapper(block, preserve_rng_state=False)``, ``apply_compile``:
each wrapped block ``torch.compile``-d; torchtitan/parallelisms/parallelize_llama.py at 9dec370), recording whether
the step runs and, per partitioned region, the kinds of the values its forward hands to its backward, in order.

Run by tests/parallel/test_compiled_tp_checkpoint_real.py under torchrun:
``python compiled_tp_checkpoint_worker.py OUT_DIR '<scenarios json>'``. A scenario: ``backend`` (``"partition"``:
trainmem's, inductor's decompositions and partition without codegen, trace/compiled.py; ``"aot_eager"``: AOTAutograd
with the min-cut partitioner, no decompositions), ``checkpoint`` (``True``: torchtitan's full AC; ``"op-sdpa-saved"``:
its op-level policy with SDPA saved, as on CUDA) and ``compile`` (either may be off: the controls), ``attention``
(``"sdpa"`` unless given; ``"eager"``: transformers' matmul-softmax attention, whose dropout at p = 0 draws no random
numbers).
"""

from __future__ import annotations


def _kind(node) -> str:
    """``tensor``, ``rng_state`` (what ``run_and_save_rng_state`` saved), ``opaque`` (a DeviceMesh: a
    FakeScriptObject in the graph) or ``symint``: how AOTAutograd's saved-value convention sorts it."""
    import torch
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    from torch._functorch.partitioners import is_sym_node

    if is_opaque_node(node):
        return "opaque"
    if is_sym_node(node):
        return "symint"
    source = node.args[0] if node.op == "call_function" and node.args else None
    if getattr(source, "target", None) is torch.ops.higher_order.run_and_save_rng_state:
        return "rng_state"
    return "tensor"


_REGIONS: list = []  # the current scenario's, filled by the wrapper below (installed once per process)


def _recording_partitions() -> None:
    """Wrap inductor's ``partition_fn``, which trainmem's backend imports when it is built, so that each
    partitioned forward's saved outputs are noted as kinds (aot_eager binds its partitioner at import)."""
    import torch._inductor.compile_fx as compile_fx

    partition = compile_fx.partition_fn
    if getattr(partition, "noting", False):
        return

    def noting(joint, inputs, **kwargs):
        fw, bw = partition(joint, inputs, **kwargs)
        outs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        _REGIONS.append([_kind(n) for n in outs[kwargs["num_fwd_outputs"]:]])
        return fw, bw

    noting.noting = True
    compile_fx.partition_fn = noting


def _op_policy_saving_sdpa():
    """torchtitan's op-level policy (trace/recompute.py ``op_sac_context``) with the CPU SDPA kernel on its save list,
    as CUDA's flash kernel is (the partitioner's compute-intensive ops): the checkpointed block recomputes no SDPA."""
    import dataclasses

    import torch
    from torch._functorch import partitioners
    from torch.utils._ordered_set import OrderedSet

    from trainmem.trace.recompute import op_sac_context

    real = partitioners.get_default_op_list
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    partitioners.get_default_op_list = lambda: dataclasses.replace(  # OpTypes, a dataclass
        real(), compute_intensive_ops=OrderedSet([*real().compute_intensive_ops, sdpa]))
    try:  # the policy reads the list when it is made; the partitioner's own min-cut keeps the real one
        return op_sac_context()
    finally:
        partitioners.get_default_op_list = real


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from trainmem.measure_dist.worker import _apply_tp
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import Compiled, partitioning_backend

    torch._dynamo.reset()
    _REGIONS.clear()
    _recording_partitions()
    torch.manual_seed(0)
    model = build_hf_model(sc["config"], attention=sc.get("attention", "sdpa"), dtype=torch.float32)
    _apply_tp(model, init_device_mesh("cpu", (dist.get_world_size(),)), True, True)
    layers = model.model.layers
    for name, layer in list(layers.named_children()):
        if sc["checkpoint"] == "op-sdpa-saved":
            layer = checkpoint_wrapper(layer, context_fn=_op_policy_saving_sdpa)
        elif sc["checkpoint"]:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        if sc["compile"]:
            backend = partitioning_backend(Compiled()) if sc["backend"] == "partition" else sc["backend"]
            layer = torch.compile(layer, backend=backend, dynamic=False)
        layers.register_module(name, layer)
    model.train()
    ids = torch.randint(0, sc["config"]["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1000))
    error = None
    try:
        with loss_parallel():  # no KV cache: what transformers' own checkpointing turns off (modeling_layers.py)
            model(ids, labels=ids, use_cache=False).loss.backward()
    except Exception as e:  # noqa: BLE001 (the failure is the result)
        error = f"{type(e).__name__}: {e}"
    from torch._dynamo.utils import counters
    return {"rank": dist.get_rank(), "error": error, "regions": list(_REGIONS),
            "graph_breaks": sum(counters["graph_break"].values())}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    worker_main(run)
