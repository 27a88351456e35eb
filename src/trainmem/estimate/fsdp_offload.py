"""FSDP's CPU offload (``--fsdp full|hybrid --offload params``): what stays on the device.

FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))``, as torchtune's
``fsdp_cpu_offload: True`` (torchtune/training/_distributed.py ``shard_model(cpu_offload=True)``)
and torchtitan's ``[training] enable_cpu_offload`` (parallelize.py ``apply_fsdp(cpu_offload=...)``)
set it, read in torch 2.13 (torch/distributed/fsdp/_fully_shard/):

* ``FSDPParam._init_sharded_param`` (_fsdp_param.py): each rank's padded shard is moved to the
  CPU (pinned with ``pin_memory``) before it becomes ``sharded_param``: the sharded fp32
  parameters live on the host, and so do the optimizer states made from them (the optimizer
  steps on the CPU: ``FSDPParamGroup._validate_cpu_offload_params`` insists on CPU parameters);
* ``FSDPParam.all_gather_inputs`` (_fsdp_param.py): before each all-gather the group's shards
  are copied to the device (``.to(self.device, non_blocking=True)``), then cast to
  ``MixedPrecisionPolicy.param_dtype`` (``_to_dtype_if_needed``; the foreach copy-in fast path of
  ``_fsdp_collectives._get_param_all_gather_inputs`` is skipped under offload). Those copies live
  until the copy-in into the all-gather buffer: ``fsdp_offload_h2d`` below;
* the all-gathered (unsharded) parameters are device tensors exactly as without offload, freed
  by ``reshard`` (``FSDPParam.free_unsharded_param``): the gathered block(s) in flight, and the
  root's parameters, which are never resharded after forward. The root's own shard is on the
  host, so the device holds its whole unsharded size (without offload the same whole root, beside
  the shard the estimate counts with the model states: ``FSDPParam.init_all_gather_outputs``);
* ``_fsdp_collectives.foreach_reduce``: a block's unsharded gradients are copied into the
  reduce-scatter input (device) and freed; the reduce-scatter output (one shard per parameter, in
  ``reduce_dtype``) is a device tensor, each parameter's view of it is copied to the CPU
  (``new_sharded_grad.to(torch.device("cpu"), non_blocking=...)``) and the device output dies
  with its last reference ("we can free it here by not keeping a ref"). The sharded gradients are
  host tensors (accumulated there under gradient accumulation); on the device the output shard
  is a transient beside the reduce-scatter input: ``fsdp_offload_d2h`` below;
* the root group (embedding, final norm, output layer) is reduced by its ``post_backward`` only at
  the end of backward, so its unsharded gradients made before the blocks' backward (the head's:
  every root parameter but the token embedding) stay on the device through it, and at the end of
  backward all of the root's: ``fsdp_root_unsharded_grads`` (without offload the estimate counts
  those gradients among the sharded model states).

FSDP1 ``CPUOffload(offload_params=True)`` keeps its flat parameter's shard and gradient shard on
the host the same way (torch/distributed/fsdp/_runtime_utils.py ``_offload_grad`` copies into
``flat_param._cpu_grad``) and its optimizer steps on the CPU: the same model states move.

So every model state (parameters, gradients, optimizer states, master weights) is a host figure,
the device holds the gathered parameters, the gradient buffers and the activations, and the
optimizer step has no device temporaries. With one FSDP2 unit per block those device tensors follow
FSDP2's per-tensor timeline (estimate/fsdp_timeline.py: ``Units.host_grads``, the copies in a middle
block's backward); elsewhere the per-phase bounds below (:func:`offload_working`). Pinned host memory is page-locked: the host figure is
what the node must have free beyond the process's ordinary memory.

What a CPU-only run can check (tests/parallel/test_fsdp_cpu_offload.py, torchrun gloo 2 ranks):
there the "device" is the CPU too (``.to(cpu)`` returns the same tensor), so the host and device
sets are told apart by tensor kind, not by device: the sharded parameters, gradients and
optimizer states equal the host figure, and everything else alive (gathered parameters,
unsharded gradients, reduce-scatter buffers, activations, temporaries) peaks where the estimate's
device figure does (to the byte on the timeline: eager and compiled, fp32 and fsdp-bf16, recompute
none and full). The two copies (``fsdp_offload_h2d``, ``fsdp_offload_d2h``) do not exist on
a CPU device and are modelled from the source only.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, MemoryItem
from trainmem.names import is_token_embedding, layer_index

__all__ = ["cpu_offload", "HOST_CATEGORIES", "offload_node_moments", "offload_states", "offload_transients",
           "offload_working"]

HOST_CATEGORIES = frozenset({Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE,
                             Category.PAGED_STATE, Category.MASTER_WEIGHT})
"""The model states FSDP's CPU offload keeps on the host (every sharded one)."""


def cpu_offload(par) -> bool:
    """``--offload params`` under FSDP: FSDP2's ``CPUOffloadPolicy`` (FSDP1's ``CPUOffload``),
    which cannot offload parameters without their gradients and optimizer states."""
    return par is not None and bool(par.fsdp) and "params" in par.offload


def offload_node_moments(impl, par) -> bool:
    """Whether a rank under CPU offload takes its blocks' node moments (estimate/peak.py ``phases``
    ``node_moments``, on the recomputed set) beside the offload buffers: under ``--recompute full``, on the
    layouts off FSDP2's per-tensor timeline (FSDP1, hybrid, separate embedding/head units); on the timeline
    (estimate/fsdp_timeline.py ``applies``) every layout takes them.

    A checkpointed block's backward first recomputes its forward, and a compiled one holds what eager
    autograd would save, not its compiled saved set (estimate/compiled_recompute.py): the coarse
    block working set (the compiled set's recompute plus the residual gradient) misses it. Measured
    against a real 2-rank gloo run (tests/parallel/test_fsdp_offload_compile.py, tiny Llama B 2 S 64,
    one unit per block) with these coarse bounds: device peak estimate/measured 0.993 (fp32) and 0.975
    (fsdp-bf16) compiled, 0.993 / 0.994 eager; without checkpointing the moments overshot (1.04 / 1.02
    eager). On the timeline the same runs are exact (session 11, docs/parallel.md)."""
    return cpu_offload(par) and impl.recompute == "full"


def offload_states(states: list[MemoryItem]) -> tuple[list[MemoryItem], int]:
    """(the states kept on the device, the bytes on the host): every sharded parameter,
    gradient, optimizer state and master weight goes to the host; buffers stay."""
    kept = [it for it in states if it.category not in HOST_CATEGORIES]
    return kept, sum(it.bytes for it in states if it.category in HOST_CATEGORIES)


def offload_transients(*, group_shard_bytes: float, group_shard_cast_bytes: float,
                       grad_shard_bytes: float) -> dict[str, dict[str, float]]:
    """Per phase, the device copies CPU offload adds for the largest FSDP group.

    ``group_shard_bytes``: the group's shards in their stored dtype (copied to the device before
    the all-gather); ``group_shard_cast_bytes``: their ``param_dtype`` cast (0 without mixed
    precision); ``grad_shard_bytes``: the group's reduce-scatter output (one gradient shard per
    parameter, in ``reduce_dtype``), alive on the device until its copy to the host."""
    h2d = group_shard_bytes + group_shard_cast_bytes
    out: dict[str, dict[str, float]] = {p: {"fsdp_offload_h2d": h2d}
                                        for p in ("forward", "backward_start", "backward")}
    for p in ("backward", "backward_end"):
        out.setdefault(p, {})["fsdp_offload_d2h"] = grad_shard_bytes
    return out


def offload_working(stage_params: list[MemoryItem], tp_div: dict[str, int], grad_bytes: dict[str, int],
                    gathered, group: int, compute_bytes: float, units: str = "blocks",
                    root_grads: bool = True) -> dict[str, dict[str, float]]:
    """:func:`offload_transients` for a stage's parameters (unsharded items; ``tp_div``: each one's
    TP/EP divisor; ``grad_bytes``: each trainable one's gradient bytes; ``gathered(item)``: bytes
    per element all-gathered; ``compute_bytes``: bytes per element of an unsharded gradient, made in
    ``param_dtype``), the largest FSDP group each (a decoder block, or the root's rest; under
    ``units='blocks+embed+head'`` the embedding and the head are groups of their own, each reduced
    right after its own backward: estimate/fsdp_units.py). ``root_grads=False`` where FSDP2's timeline
    (estimate/fsdp_timeline.py) counts the root's unsharded gradients as autograd's gradients."""
    from trainmem.estimate.fsdp_units import separate_unit

    groups: dict[int | str | None, list[float]] = {}
    head = first = 0.0  # the root's unsharded gradients: made before the blocks' backward / after
    for i in stage_params:
        unit = separate_unit(i.name, units)
        if layer_index(i.name) is None and unit is None:
            g = math.prod(i.shape) / tp_div[i.name] * compute_bytes if grad_bytes.get(i.name) else 0.0
            first += g if is_token_embedding(i.name) else 0.0
            head += 0.0 if is_token_embedding(i.name) else g
        numel = math.prod(i.shape) / tp_div[i.name]
        stored = i.bytes / tp_div[i.name]
        cast = numel * gathered(i)
        acc = groups.setdefault(unit or layer_index(i.name), [0.0, 0.0, 0.0])
        acc[0] += stored / group
        acc[1] += (cast if cast != stored else 0.0) / group
        acc[2] += grad_bytes.get(i.name, 0) / tp_div[i.name] / group
    if not groups:
        return {}
    h2d = max(groups.values(), key=lambda a: a[0] + a[1])
    out = offload_transients(group_shard_bytes=h2d[0], group_shard_cast_bytes=h2d[1],
                             grad_shard_bytes=max(a[2] for a in groups.values()))
    for ph, v in (("backward", head), ("backward_end", head + first)) if root_grads else ():
        out[ph]["fsdp_root_unsharded_grads"] = v
    return out


# --- activation offload per rank (``--offload activations`` with FSDP, ZeRO or DDP) -------------
#
# torchtune's distributed recipe (recipes/full_finetune_distributed.py, _setup_model) wraps the
# forward in the same ``training.get_act_offloading_ctx_manager(model, enable_activation_offloading)``
# as the single-device recipe, after ``shard_model``. Under data parallelism alone (no TP, CP, PP or
# EP) every rank runs the whole model on its own micro-batch, and FSDP2's hooks save nothing for
# backward (``RegisterPostBackwardFunction`` is an identity); a linear layer saves ``weight.t()`` of
# the unsharded parameter, a view that is no ``nn.Parameter``, so it is copied out and back as on one
# device (in ``param_dtype``: the gathered weights are the compute dtype). So a rank's saved
# activations split between device and host exactly as one device's would
# (estimate/activation_offload.py), and the rank's FSDP buffers and state placement add to that.

def composes_with_activation_offload(impl, par) -> bool:
    """``--offload activations`` where each rank's split is the single-device one: the hf rules,
    data parallelism only (DDP, ZeRO or FSDP)."""
    return (par is not None and "activations" in par.offload and impl.profile == "hf"
            and par.tp == par.cp == par.pp == par.ep == 1)


def rank_activation_offload(model, step, impl, acts: list[MemoryItem], recompute: dict, finetune=None):
    """(device activation items, host bytes, recompute bytes per block, working buffers per phase)
    of one data-parallel rank under activation offload: the single-device split of its step."""
    from trainmem.estimate.activation_offload import apply_offload
    from trainmem.inventory import Inventory

    inv, rec, working, host = apply_offload(model, step, impl, Inventory(()), Inventory(acts), recompute, finetune)
    return list(inv), host.total(), rec, working
