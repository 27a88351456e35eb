"""``trainmem trace --tp N [--sp]``: the real DTensor tensor-parallel step as rank 0 of N in torch's
fake process group (trace/parallel_tp.py), against ``estimate --tp N --device cpu`` (profile hf).

Measured on the tiny Llama (hidden 64, 2 layers, untied, B 2, S 64, AdamW), tp 2:
  - parameters, gradients, AdamW states: == the estimate's to the byte (fp32, bf16, with and without
    --sp, gathered logits); in both the embedding's gradient is 65,536 B, the full table's size;
  - activations (the trace's activation + input ledgers) == the estimate's + 4 B: the trace also
    counts backward's gradient seed (``ones_like`` of the 0-d loss), as on one device (+4 B there too);
  - the step peak under loss_parallel == the estimate's: the trace runs loss_parallel's cross-entropy
    handlers (torch/distributed/tensor/parallel/loss.py) with its dispatch mode pushed back, so their
    local temporaries are recorded (trace/dtensor_handlers.py; before, estimate/trace 1.07-1.09, and a
    real gloo step's allocator peak equals the trace: tests/parallel/test_tp_loss_parallel_exact.py). With gathered logits
    (--no-loss-parallel) equal too: the trace's waits return their input as a real group's do
    (trace/dtensor_handlers.py ``waits_return_their_input``; before, fp32 read 0.97: each fake
    ``wait_tensor`` made a second copy of the logits' all-gather output).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from trainmem.cli import main  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
IMPL = ImplSpec(device="cpu", attention="sdpa")


def _cli(capsys, *argv):
    rc = main(["trace", "--model", "llama-3-8b", "--seq", "16", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,flag", [
    # TP inside pipeline stages runs (tests/estimate/test_compiled_3d.py); compiled, it needs --sp as TP alone
    (["--tp", "2", "--pp", "2", "--microbatches", "2", "--compile", "--compile-scope", "block"], "sp=False"),
    (["--tp", "2", "--cp", "2"], "--cp 2"),
    (["--tp", "2", "--ep", "2"], "--ep 2"),
    (["--tp", "2", "--zero", "1"], "--zero 1"),
    (["--tp", "2", "--dp", "2"], "--dp 2"),
    (["--tp", "2", "--dp", "2", "--fsdp", "full", "--fsdp-version", "1"], "--tp 2"),  # FSDP2: test_trace_2d.py
    (["--sp"], "--sp"),
    (["--tp", "3"], "tp=3"),  # llama-3-8b: 32 heads, 8 KV heads
    (["--tp", "2", "--sp", "--seq", "15"], "tp=2"),
    (["--tp", "2", "--profile", "reference"], "--tp"),  # trainmem's reference model has no tp plan
])
def test_what_tp_trace_cannot_run_is_one_line(capsys, argv, flag):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and flag in err


@pytest.mark.parametrize("impl,sp,match", [
    (ImplSpec(device="cpu", compile=True), False, "--compile with --tp"),
    (ImplSpec(device="cpu", optimizer_impl="foreach"), False, "foreach kernels refuse a mix"),
])
def test_what_tp_trace_refuses_before_building(impl, sp, match):
    from trainmem.errors import UnsupportedError
    from trainmem.trace import trace_step

    with pytest.raises(UnsupportedError, match=match):
        trace_step(LLAMA, StepSpec(batch=1, seq=16), impl, parallel=ParallelSpec(tp=2, sp=sp))


def _ledgers(items) -> dict[str, int]:
    out: dict[str, int] = collections.defaultdict(int)
    for it in items:
        out[it.category.value] += it.bytes
    return out


CASES = [("fp32", False, True), ("bf16", False, True), ("fp32", True, True), ("bf16", True, True),
         ("fp32", False, False)]
# estimate / trace step peak (logical bytes): equal. Before trace/dtensor_handlers.py: 1.0703, 1.0877, 1.0668,
# 1.0897 (the handlers' tensors unrecorded) and 0.9704 (fp32 gathered: each wait_tensor's fake output a second copy
# of its all-gather's)
PEAK_RATIO = {("fp32", False, True): (1.0, 1.0), ("bf16", False, True): (1.0, 1.0),
              ("fp32", True, True): (1.0, 1.0), ("bf16", True, True): (1.0, 1.0),
              ("fp32", False, False): (1.0, 1.0)}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_tp2_trace_against_the_estimate(case):
    from trainmem.trace import trace_step

    precision, sp, loss_parallel = case
    par = ParallelSpec(tp=2, sp=sp, loss_parallel=loss_parallel)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    traced = trace_step(LLAMA, step, IMPL, parallel=par)
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, IMPL, parallel=par).ranks
    t, e = _ledgers(traced.items), _ledgers(rank.inventory.items)
    for ledger in ("parameter", "gradient", "optimizer_state", "buffer"):
        assert t[ledger] == e[ledger], ledger
    # parameters: each block's 7 linears halved, norms whole; embedding and head V/2 rows
    width = 4 if precision == "fp32" else 2
    assert t["parameter"] == width * (2 * (46_208 - 128) // 2 + 2 * 128 + 2 * 128 * 64 + 64)
    assert t["activation"] + t["input"] == e["activation"] + 4  # backward's 0-d gradient seed
    assert traced.meta["tp"] == {"world_size": 2, "rank": 0, "sp": sp, "loss_parallel": loss_parallel,
                                 "process_group": "fake"}
    lo, hi = PEAK_RATIO[case]
    assert lo <= rank.peak_bytes / traced.peak_logical_bytes <= hi


@pytest.mark.slow
def test_cli_traces_tp(capsys, tmp_path):
    import json

    from trainmem.trace import trace_step

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc = main(["trace", "--model", str(cfg), "--batch", "2", "--seq", "64", "--tp", "2", "--sp", "--device", "cpu",
               "--attention", "sdpa", "--optimizer", "adamw", "--precision", "bf16", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    got = json.loads(out)
    traced = trace_step(LLAMA, StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw"), IMPL,
                        parallel=ParallelSpec(tp=2, sp=True))
    assert got["peak_logical_bytes"] == traced.peak_logical_bytes
    rc = main(["trace", "--model", str(cfg), "--batch", "2", "--seq", "64", "--tp", "2", "--device", "cpu",
               "--attention", "sdpa"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "TP: rank 0 of 2 (torch's fake process group)" in out
