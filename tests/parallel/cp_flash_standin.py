"""SDPA as CUDA's flash dispatch, on fake tensors: torch's context parallelism run unmodified on CPU (a probe).

torch 2.13's CP dispatches SDPA to its ring only for the CUDA kernels
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``: ``_sdpa_handler``'s table and
``_sharding_rules.py`` ``register_cp_sharding_rules`` list flash, efficient and cuDNN); on CPU, SDPA is
``_scaled_dot_product_flash_attention_for_cpu``, which DTensor refuses. :func:`flash_sdpa` makes
``F.scaled_dot_product_attention`` call ``aten._scaled_dot_product_flash_attention``, the op CUDA's SDPA picks
for flash (``aten/src/ATen/native/transformers/attention.cpp`` ``scaled_dot_product_attention``, backend
``flash_attention``), so ``context_parallel`` wraps it and DTensor runs torch's own ring for it. The op has no CPU
kernel: this runs on fake tensors only (its meta kernel, ``torch/_meta_registrations.py``
``meta__scaled_dot_product_flash_attention``), which is how trainmem traces.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def flash_sdpa():
    """``F.scaled_dot_product_attention`` replaced by the CUDA flash op for the duration (no mask, no GQA flag:
    transformers passes neither for a causal Llama with equal K/V heads after ``repeat_kv``)."""
    import torch
    import torch.nn.functional as F

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if attn_mask is not None or enable_gqa:
            raise NotImplementedError("the flash stand-in takes no mask and no enable_gqa")
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]

    # context_parallel re-binds F by the replaced function's __name__ (_attention.py _distribute_function)
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def cp_world(cp: int, rank: int = 0):
    """Rank ``rank`` of ``cp`` in torch's fake process group and a 1-D CPU mesh over it (as
    ``trainmem.trace.parallel_fsdp.fake_world``, which is rank 0 only: the ring's work differs by rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmem.trace.parallel_fsdp import forget_meshes_of_other_worlds

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=max(cp, 2))
    forget_meshes_of_other_worlds()
    try:
        yield init_device_mesh("cpu", (max(cp, 2),))
    finally:
        dist.destroy_process_group()
        forget_meshes_of_other_worlds()


def cp_saved(config: dict, cp: int, seq: int, rank: int = 0, full: bool = False) -> list:
    """What autograd keeps (``trainmem.trace.saved.saved_tensors``) for one forward of the transformers model of
    ``config`` (bf16, fake tensors, B=1) on rank ``rank`` of torch's own ``context_parallel`` over the ids with
    :func:`flash_sdpa` standing in for SDPA; ``cp=1``: one device with the same op at ``seq``; ``full``: each
    block checkpointed (transformers' non-reentrant gradient checkpointing)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.saved import saved_tensors

    cfg = AutoConfig.for_model(**config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    old = torch.get_default_dtype()
    with cp_world(cp, rank) as mesh, FakeTensorMode(), masks_as_on_real_tensors(), flash_sdpa():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = AutoModelForCausalLM.from_config(cfg).train()
            if full:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            ids = torch.randint(0, cfg.vocab_size, (1, seq))  # cut to the rank's chunks in place
            with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]) if cp > 1 else contextlib.nullcontext():
                saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
                loss.backward()
        finally:
            torch.set_default_dtype(old)
    return saved


class _WaitAliases:
    """``_c10d_functional.wait_tensor`` returning its input, as the real op does (its Meta kernel,
    ``torch/distributed/_functional_collectives.py`` ``_wait_tensor_meta``, returns ``empty_like``: on fake
    tensors every wait would count its collective's output twice)."""

    def __new__(cls):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class WaitAliases(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops._c10d_functional.wait_tensor.default:
                    return args[0]
                return func(*args, **(kwargs or {}))

        return WaitAliases()


@contextlib.contextmanager
def _ring_recorded(recorder, waits, calls: list):
    """torch's ring functions run with ``recorder`` (the trace's dispatch mode) and ``waits`` pushed again: the
    tracer otherwise sees the SDPA op once, on DTensors, and not the local ops DTensor's CP handler runs for
    it. Only the ring functions, not ``_sdpa_handler``'s sharding propagation, which runs the op on
    global-shape fake tensors that a device never allocates. ``calls``: (function, first event, end event)."""
    import torch.distributed.tensor.experimental._context_parallel._attention as attention
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    names = ("_scaled_dot_product_ring_flash_attention", "_scaled_dot_product_ring_flash_attention_backward")
    originals = {n: getattr(attention, n) for n in names}  # _sdpa_handler looks them up at each call

    def recorded(name, fn):
        def run(*args, **kwargs):
            start = len(recorder.rec.events)
            _push_mode(waits)
            _push_mode(recorder)
            try:
                return fn(*args, **kwargs)
            finally:
                _pop_mode()
                _pop_mode()
                calls.append((name, start, len(recorder.rec.events)))
        return run

    for n in names:
        setattr(attention, n, recorded(n, originals[n]))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(attention, n, fn)


def traced_ring_step(config: dict, cp: int, seq: int, rank: int = 0, batch: int = 1, *, full: bool = False,
                     precision: str = "bf16"):
    """One traced training step (AdamW, fake tensors) of rank ``rank`` of ``cp`` under torch's
    ``context_parallel``, the ring's local ops recorded (:func:`_ring_recorded`): ``(TraceResult, calls)``,
    ``calls`` a list of (ring function, most bytes above its entry, bytes it leaves; :func:`host_on_cuda`'s left
    out). ``full``: each block
    checkpointed (transformers' non-reentrant gradient checkpointing); ``precision``: bf16 or fp32."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.trace.api import Tracer
    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.optimizers import make_optimizer_for

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    cfg = AutoConfig.for_model(**config, attn_implementation="sdpa", torch_dtype=dtype)
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    impl = ImplSpec(device="cuda", attention="sdpa", recompute="full" if full else "none")
    waits, spans = _WaitAliases(), []
    old = torch.get_default_dtype()
    with cp_world(cp, rank) as mesh, FakeTensorMode(), waits, masks_as_on_real_tensors(), flash_sdpa():
        torch.set_default_dtype(dtype)
        try:
            model = AutoModelForCausalLM.from_config(cfg).train()
        finally:
            torch.set_default_dtype(old)
        if full:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _, _, optimizer = make_optimizer_for(model, step, impl)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))

        def one_step(ring=contextlib.nullcontext()):
            with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]), ring:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        one_step()  # the optimizer's states exist from the traced step's start
        tracer = Tracer(model, optimizer, inputs=[ids])
        with tracer:
            one_step(_ring_recorded(tracer._rec, waits, spans))
    rec = tracer.result.recording
    live, lives = 0, []
    for e in rec.events:
        block = rec.blocks[e if e >= 0 else ~e]
        if not host_on_cuda(block):
            live += block.nbytes * (1 if e >= 0 else -1)
        lives.append(live)
    calls = [(name, max(lives[a:z]) - lives[a - 1], lives[z - 1] - lives[a - 1]) for name, a, z in spans]
    return tracer.result, calls


def host_on_cuda(block) -> bool:
    """The flash op's philox seed and offset (uint64, two and one elements): its meta kernel makes them on the
    device, CUDA's kernel on the host without dropout (as tests/estimate/test_rules_mla_cuda.py leaves them out)."""
    return block.op == "_scaled_dot_product_flash_attention" and block.dtype.endswith("uint64")
