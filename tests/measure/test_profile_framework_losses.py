"""``trainmem profile --loss torchtune-chunked-ce|litgpt-chunked-ce`` runs the framework's loss on
real tensors (measure/workload.py, through trace/losses.framework_loss) instead of silently measuring
plain cross-entropy: the measured CPU peak follows the trace's logical peak for each loss.

The profile's live-set meter also counts Adam's 0-dim step counters (one fp32 scalar per parameter
tensor, 21 here = 84 B), which the tracer files as CPU scalars; LitGPT's step measures 16 B less
than that bound beside the trace (loss scalars the trace still holds at its peak), not explained
further."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=1000, max_position_embeddings=1024)
STEP_COUNTERS = 21 * 4  # 2 blocks x 9 tensors + embedding + final norm + head, fp32 scalars


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(CFG))
    return str(path)


def _run(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) in (0, None)
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_profile_measures_the_framework_losses(capsys, cfg):
    common = ("--model", cfg, "--device", "cpu", "--seq", "64", "--batch", "2", "--precision", "fp32")
    peaks = {}
    for loss in ("ce", "torchtune-chunked-ce", "litgpt-chunked-ce"):
        measured = _run(capsys, "profile", *common, "--loss", loss)["peak_bytes"]
        traced = _run(capsys, "trace", *common, "--loss", loss)["peak_logical_bytes"]
        assert 0 <= measured - traced <= STEP_COUNTERS, (loss, measured, traced)
        peaks[loss] = measured
    # torchtune's chunks lower the peak below plain CE's; LitGPT's logits, held through the step, raise it
    assert peaks["torchtune-chunked-ce"] < peaks["ce"] < peaks["litgpt-chunked-ce"]
