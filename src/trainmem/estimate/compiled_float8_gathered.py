"""What a compiled Llama block keeps at ``--recompute none`` when FSDP2 gathers its Float8 weights in fp8
(``--float8 tensorwise --float8-all-gather --compile --compile-scope block``).

The block's graph inputs are each converted weight as torchao's ``Float8TrainingTensor``
(torchao/float8/fsdp_utils.py ``WeightWithDynamicFloat8CastTensor.fsdp_post_all_gather``): AOTAutograd flattens it
into two inputs, the gathered fp8 data and its fp32 scale. Each weight's input gradient needs it in column-major
layout (float8_linear.py ``matmul_with_hp_or_float8_args.backward``: ``_scaled_mm`` reads its second operand
column-major, a ``clone`` of the transposed fp8 weight), so the partitioner saves either that copy (out·in bytes) or
the gathered data itself (no bytes: FSDP2 frees it after forward and gathers it again for backward).

Which one follows from the partitioner's node weights (torch/_functorch/partitioners.py ``get_node_weight``): an
input in ``static_lifetime_input_nodes`` is free to save (``config.treat_parameters_as_free_to_save``); any other node
costs its size times 1.1 per step from the backward, so the copy (one step) is cheaper than the data (two). In torch
2.13 the static indices the partitioner receives are the subclass-level ones (torch/_functorch/_aot_autograd/
graph_compile.py ``_partition_joint_graph_into_fw_bw`` passes ``fw_metadata.static_input_indices``, not the flattened
``inner_meta``'s that graph_capture_wrappers.py ``remap_unwrapped_subclass_arg_indices`` made) while its joint graph
has the flattened inputs: a weight's fp8 data is free only where its flattened position happens to be a parameter's
position before flattening (:func:`saved_weight_copies`). In the Llama block (inputs in first-use order: the hidden
states, the input norm's weight, q, k, v, the rotary cos and sin, o, the post-attention norm's weight, gate, up,
down) that is q's, k's and o's; v, gate, up and down keep their copy (read off the partitioned graph of the tiny
Llama under FSDP2 on the fake process group, where the partitioner received the static indices 1-4 and 7-11).

Each weight's amax is not kept (its scale arrives gathered); the inverse scales are, as without the fp8 all-gather.
Each forward scale stays the parameter's ``_scale`` until the block's backward all-gather is waited on
(``fsdp_post_all_gather``: ``out._scale = scale``), so it is counted with the block's saved set (``param_scale``, 4 B
per weight; autograd does not hold it) and freed at its backward (compiled_float8_moment.py). The backward's MLP
moments are the product's cast and SiLU's backward, without weight casts. Checked: tests/estimate/
test_float8_compiled_recompute.py ``GATHERED_CASES`` (estimate == trace, saved set and backward peak).
"""

from __future__ import annotations

__all__ = ["saved_weight_copies"]


def saved_weight_copies(inputs: tuple[tuple[str, bool, bool], ...]) -> set[str]:
    """The fp8 weights whose column-major copy the block saves (module docstring), from its graph inputs in order,
    each ``(name, is a parameter, is an fp8 Float8TrainingTensor)``: a subclass is flattened into its data and scale."""
    static = {i for i, (_, param, _) in enumerate(inputs) if param}  # the subclass-level indices
    copies, flat = set(), 0
    for name, _, fp8 in inputs:
        if fp8 and flat not in static:
            copies.add(name)
        flat += 2 if fp8 else 1
    return copies
