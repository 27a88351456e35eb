"""trainmem.largest_micro_batch: peak(B) fits and peak(B + 1) does not, by the estimate or the trace."""

import pytest

import trainmem
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.allocation_order import estimate_reserved
from trainmem.plan.hardware import Reserve
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import load_model


def _usable(gpu_file: str) -> int:
    from trainmem.plan.hardware import load_gpu
    gpu = load_gpu(gpu_file.removesuffix(".json"))  # its context: CUDA context + cuBLAS workspaces (device_context)
    return gpu.memory_bytes - gpu.context_bytes  # capacity − context: the reserved figure's budget


def test_estimate_backend_is_the_largest_that_fits():
    model = load_model("llama-2-7b")
    step = StepSpec(seq=4096, precision="bf16")
    impl = ImplSpec(attention="flash", recompute="full")
    fit = trainmem.largest_micro_batch(model, step=step, impl=impl, gpu="H100-80GB")
    usable = _usable("h100-80gb.json")
    assert fit.budget.usable_bytes == usable
    b = fit.batch
    assert b is not None and b >= 1 and not fit.capped
    from dataclasses import replace
    at, after = (estimate(model, replace(step, batch=n), impl) for n in (b, b + 1))
    held, next_held = estimate_reserved(at).reserved_bytes, estimate_reserved(after).reserved_bytes
    assert held <= usable < next_held  # the reserved peak, as plan/advise/sweep --gpu compare it
    assert (fit.peak_bytes, fit.next_peak_bytes) == (at.peak_bytes, after.peak_bytes)
    assert (fit.reserved_bytes, fit.next_reserved_bytes) == (held, next_held)


def test_parallel_and_finetune_are_searched_too():
    model = load_model("llama-3-8b")
    lora = trainmem.largest_micro_batch(model, seq=2048, step=StepSpec(precision="bf16"), gpu="A100-40GB",
                                        finetune=FinetuneSpec(mode="lora", lora_rank=16))
    full = trainmem.largest_micro_batch(model, seq=2048, step=StepSpec(precision="bf16"), gpu="A100-40GB")
    assert full.batch is None  # 8B params + grads + AdamW states in bf16 alone exceed 40 GB
    assert lora.batch is not None and lora.batch >= 1
    zero3 = trainmem.largest_micro_batch(model, seq=2048, step=StepSpec(precision="bf16"), gpu="A100-40GB",
                                         parallel=ParallelSpec(dp=8, zero=3))
    assert zero3.batch is not None
    assert zero3.reserved_bytes <= zero3.budget.usable_bytes < zero3.next_reserved_bytes
    assert zero3.budget.usable_bytes == _usable("a100-40gb.json") - (256 << 20)  # NCCL's buffers on 8 ranks


@pytest.mark.slow  # ~7 s on CI's two cores
def test_trace_backend_on_a_config():
    from integrations_tiny import LLAMA
    from trainmem.trace import trace_step
    impl = ImplSpec(attention="eager", device="cpu")
    step = StepSpec(seq=128, precision="fp32")
    fit = trainmem.largest_micro_batch(LLAMA, step=step, impl=impl, gpu_memory="1.11GiB", backend="trace",
                                       max_batch=256)
    b = fit.batch
    assert b is not None and not fit.capped
    from dataclasses import replace
    assert trace_step(LLAMA, replace(step, batch=b), impl).peak_reserved_bytes <= fit.budget.usable_bytes
    assert trace_step(LLAMA, replace(step, batch=b + 1), impl).peak_reserved_bytes > fit.budget.usable_bytes


def test_capped_and_bad_input():
    model = load_model("gpt2")
    fit = trainmem.largest_micro_batch(model, seq=128, gpu="H200", max_batch=4)
    assert fit.capped and fit.batch == 4 and fit.next_peak_bytes is None
    with pytest.raises(SpecError, match="gpu_memory"):
        trainmem.largest_micro_batch(model, seq=128)
    with pytest.raises(SpecError, match="backend"):
        trainmem.largest_micro_batch(model, seq=128, gpu="H200", backend="device")
    with pytest.raises(SpecError, match="max_batch"):
        trainmem.largest_micro_batch(model, seq=128, gpu="H200", max_batch=0)
    with pytest.raises(UnsupportedError, match="config"):
        trainmem.largest_micro_batch(model, seq=128, gpu="H200", backend="trace")
    fit = trainmem.largest_micro_batch(model, seq=128, gpu_memory="1.02GiB", reserve=Reserve(fraction=0.05))
    assert fit.batch is None and fit.peak_bytes is None  # 1.02 GiB − 1 GiB − 5% < 0


def test_exports():
    assert {"guard", "largest_micro_batch", "DoesNotFit"} <= set(trainmem.__all__)
    from trainmem.integrations import DoesNotFit
    assert DoesNotFit is trainmem.DoesNotFit  # one class, wherever it is imported from
    from trainmem.integrations import guard, largest_micro_batch
    assert trainmem.guard is guard and trainmem.largest_micro_batch is largest_micro_batch
    with pytest.raises(AttributeError):
        trainmem.nothing_here  # noqa: B018
    import trainmem.integrations as integrations
    for name in integrations.__all__:
        assert getattr(integrations, name).__name__ == name
