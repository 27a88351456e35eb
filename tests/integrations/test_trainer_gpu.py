"""The callback's CUDA path: the device's own capacity, torch.cuda's allocated and reserved peaks.
Skipped without a CUDA device; it has not yet run on one (no GPU was lent to this work), so its
tolerance is the callback's default (10%), not a measured agreement."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_callback_on_cuda(tmp_path):
    from integrations_tiny import Tokens, tiny_llama, training_args
    from transformers import Trainer

    from trainmem.integrations.hf import TrainMemCallback

    cb = TrainMemCallback(on_oom="stop")  # no gpu=: the device's total_memory is read
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, use_cpu=False, bf16=True),
                      train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    check, measured = cb.report.check, cb.report.measured
    assert check.run.impl.device == "cuda" and check.run.step.precision == "amp-bf16"
    assert check.budget.gpu.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert check.fits is True
    assert measured.peak_reserved_bytes >= measured.peak_bytes > 0
    assert cb.report.agrees, f"measured/predicted = {cb.report.ratio:.3f}"
