"""TrainMemCallback in a real Hugging Face Trainer on CPU when the run fits only by flushing the
allocator cache (trainmem.fits.FIT_STATES ``fits_with_cache_flush``): the check warns and, even with
``on_oom="stop"``, training goes on; ``log_history`` records the state.

Llama h256/L2/V32000, fp32, sdpa, the Trainer's default adamw_torch_fused, B=2, S=256. Its estimate's
allocation order replayed through the caching-allocator model needs 461,373,440 B reserved on an
unlimited device (allocated peak 435,701,000 B); replayed at one byte less with the allocator's
release-and-retry (c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc`` →
``release_cached_blocks``) it runs with one flush per step (measured on this project's machine,
estimate/allocation_order.py at the commit of this test).
"""

import logging

import pytest

pytest.importorskip("transformers")

from integrations_tiny import LLAMA, Tokens, training_args  # noqa: E402
from transformers import Trainer  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.allocation_order import estimate_reserved  # noqa: E402
from trainmem.integrations.hf import TrainMemCallback, run_from_trainer  # noqa: E402
from trainmem.integrations.check import resolve_budget  # noqa: E402

CFG = dict(LLAMA, hidden_size=256, intermediate_size=688, vocab_size=32000)
SEQ = 256
GIB = 1 << 30


@pytest.mark.slow  # a model build and one real Trainer step at V=32000: ~5 s on CI's two cores
def test_a_run_that_fits_only_by_flushing_warns_and_trains_on(tmp_path, caplog):
    import torch

    from trainmem.models.hf import build_hf_model
    torch.manual_seed(0)
    model = build_hf_model(CFG, attention="sdpa")
    data = Tokens(n=4, seq=SEQ, vocab=CFG["vocab_size"])
    args = dict(per_device_train_batch_size=2, max_steps=1)
    run = run_from_trainer(model, training_args(tmp_path, **args), None, train_dataset=data)
    reserved = estimate_reserved(estimate(run.model, run.step, run.impl)).reserved_bytes
    # usable = capacity − the context of a size-only device (H100-80GB's: 1 GiB and two cuBLAS
    # workspaces, trainmem/device_context.py) = the reserved peak − 1 byte
    context = resolve_budget(gpu_memory=GIB).reserve.fixed_bytes
    cb = TrainMemCallback(gpu_memory=context + reserved - 1, on_oom="stop", measure_steps=1)
    trainer = Trainer(model=model, args=training_args(tmp_path, **args), train_dataset=data, callbacks=[cb])
    with caplog.at_level(logging.INFO, logger="trainmem"):
        trainer.train()
    assert trainer.state.global_step == 1  # not stopped: the step runs
    check = cb.report.check
    assert (check.fit_state, check.fits, check.runs) == ("fits_with_cache_flush", False, True)
    assert check.predicted_reserved_bytes == reserved and check.budget.usable_bytes == reserved - 1
    assert check.flush.flushes == 1 and check.flush.reserved_bytes <= reserved - 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fits ONLY BY FLUSHING THE ALLOCATOR CACHE (reserved peak over by 1 B)" in m for m in warnings)
    (entry,) = [e for e in trainer.state.log_history if "trainmem/fit_state" in e]
    assert entry["trainmem/fit_state"] == "fits_with_cache_flush" and entry["step"] == 0
    assert cb.report.measured is not None and len(cb.report.measured.step_peaks_bytes) == 1
