"""``--compile``: the compiled step's trace on fake tensors against the same compiled step on real
CPU tensors (issue 13, mechanism 1).

The real side is torch.compile itself with the ``trainmem_partition`` backend (inductor's
decompositions and min-cut partition, no codegen) on real tensors, measured by
``saved_tensors_hooks`` (what autograd keeps) and the live-storage meter (the step peak); nothing
of the tracer runs there. Inductor proper (C++ codegen with gcc) saved the same 38 tensors,
1652276 bytes, for the fp32 Llama below; that check takes minutes here and is in docs/compile.md,
not in the suite. Compilation takes 30-60 s per model on two CPU cores: the traces are marked slow.
"""

import pytest

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, StepSpec

torch = pytest.importorskip("torch")
from tiny_models import GPT2, LLAMA  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402


def test_compile_is_a_validated_bool():
    assert ImplSpec(compile=True).compile and not ImplSpec().compile
    with pytest.raises(SpecError, match="compile"):
        ImplSpec(compile="yes")


FRESH = """
import json, sys
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step
config, step, impl = json.loads(sys.argv[1])
r = trace_step(config, StepSpec(**step), ImplSpec(**impl))
print(json.dumps({"peak_logical_bytes": r.peak_logical_bytes, "meta": r.meta}))
"""


def _fresh_trace(config: dict, step: dict, impl: dict) -> dict:
    """``trace_step`` in a fresh interpreter: its peak and meta."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps([config, step, impl])], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _real_compiled_step(config, step: StepSpec, impl: ImplSpec):
    """(bytes autograd saves in the compiled forward, peak live bytes of the compiled step, Adam's
    host step counters' bytes, partitioned regions), on
    real CPU tensors, the step's optimizer as the tracer makes it, after one warm-up step."""
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import compile_model
    from trainmem.trace.optimizers import make_optimizer_for
    from trainmem.trace.recompute import enable_recompute
    from trainmem.trace.saved import saved_tensors, step_peak_bytes

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype({"fp32": torch.float32, "bf16": torch.bfloat16}[step.precision])
    try:  # as from_pretrained(torch_dtype=...) and the tracer build it: buffers computed in fp32 stay fp32
        model = build_hf_model(config, attention=impl.attention)
    finally:
        torch.set_default_dtype(old)
    model.train()
    enable_recompute(model, impl)  # transformers' gradient checkpointing, as the tracer enables it
    compiled, record = compile_model(model, impl)
    _, _, opt = make_optimizer_for(model, step, impl)
    ids = torch.randint(0, 1000, (step.batch, step.seq))

    def one_step():
        compiled(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()
    saved, out = saved_tensors(model, lambda: compiled(ids, labels=ids).loss)
    del out
    host_steps = 4 * sum(1 for s in opt.state.values() if "step" in s)  # Adam's fp32 step counters
    return sum(t.nbytes for t in saved), step_peak_bytes(model, opt, one_step), host_steps, len(record.regions)


@pytest.mark.slow
@pytest.mark.parametrize("family,config,precision,regions,recompute", [
    ("llama", LLAMA, "fp32", 1, "none"), ("llama", LLAMA, "bf16", 1, "none"), ("gpt2", GPT2, "fp32", 2, "none"),
    # checkpointed blocks inside the compiled model: the loss breaks the graph; each recomputed SDPA
    # replays a saved CPU generator state (5056 bytes, a fake one on fake tensors)
    ("llama", LLAMA, "fp32", 2, "full"), ("llama", LLAMA, "bf16", 2, "op")])
def test_compiled_trace_equals_a_real_compiled_step(family, config, precision, regions, recompute):
    step = StepSpec(batch=2, seq=64, precision=precision)
    impl = ImplSpec(device="cpu", optimizer_impl="foreach", compile=True, recompute=recompute)
    # the fake trace runs in a fresh interpreter, as `trainmem trace` does: in the slow suite's process an earlier
    # test left state (not found yet) under which the full-recompute case's trace held the logits through the loss
    # region's backward (+510,976 B, CI of 4d58777); alone, or after every tests/trace and every compile test
    # before it, it does not
    fake = _fresh_trace(config, dict(batch=2, seq=64, precision=precision),
                        dict(device="cpu", optimizer_impl="foreach", compile=True, recompute=recompute))
    c = fake["meta"]["compile"]
    assert fake["meta"]["fake"] and c["backend"] == "trainmem_partition"
    saved_bytes, peak_bytes, host_steps, real_regions = _real_compiled_step(config, step, impl)
    assert c["regions"] == real_regions == regions  # GPT-2 graph-breaks once; each region is partitioned alone
    assert c["saved_compiled_bytes"] == saved_bytes
    # the trace counts the token ids (an input, B*S*8 bytes) and never Adam's host-side step
    # counters; the live meter's baseline is the other way round
    assert fake["peak_logical_bytes"] - step.batch * step.seq * 8 + host_steps == peak_bytes
    assert c["saved_compiled_bytes"] < c["saved_eager_bytes"]
    if family == "llama" and precision == "fp32" and recompute == "none":
        # B=2, S=64, H=64, F=176, 4 heads of 16, V=1000, 2 layers, fp32 (4 bytes):
        #   per layer: block input, normed input, V, roped K and Q, SDPA output, o_proj output,
        #     normed MLP input: 8 x B*S*H*4 = 8 x 32768; gate, up, act*up: 3 x B*S*F*4 = 3 x 90112;
        #     two RMSNorm rsqrt B*S*4 = 512 each; SDPA logsumexp B*heads*S*4 = 2048
        #   per layer 8*32768 + 3*90112 + 2*512 + 2048 = 535552; two layers 1071104
        #   final: residual and normed (2 x 32768), rsqrt 512, logits B*S*V*4 = 512000,
        #     cross-entropy's row max and log-sum (2 x B*S*4 = 2 x 512), its 0-dim count 4
        #   = 65536 + 512 + 512000 + 1024 + 4 = 579076
        #   ids B*S*8 = 1024, labels padded to S+1: B*65*8 = 1040, rotary inv_freq 8*4 = 32
        # 1071104 + 579076 + 1024 + 1040 + 32 = 1652276 (inductor proper: the same)
        assert c["saved_compiled_bytes"] == 1652276
        assert c["saved_compiled_tensors"] == 38


def test_compile_line_names_both_saved_sets():
    from trainmem.trace.cli import compile_line

    line = compile_line({"backend": "trainmem_partition", "regions": 1, "saved_eager_bytes": 2003460,
                         "saved_eager_tensors": 44, "saved_compiled_bytes": 1652276, "saved_compiled_tensors": 38})
    # 2003460 / 2**20 = 1.91; 1652276 / 2**20 = 1.58
    assert line == ("saved for backward: eager 1.91 MiB (44 tensors), compiled 1.58 MiB (38 tensors) "
                    "in 1 region(s), backend trainmem_partition")


@pytest.mark.slow
def test_trace_cli_compile_json(tmp_path, capsys):
    import argparse
    import json

    from trainmem.trace import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    parser = argparse.ArgumentParser(prog="trainmem")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["trace", "--model", str(path), "--batch", "2", "--seq", "64", "--precision", "fp32",
                              "--compile", "--json", "--progress", "never"])
    assert args.func(args) == 0
    d = json.loads(capsys.readouterr().out)
    c = d["meta"]["compile"]
    assert d["inputs"]["impl"]["compile"] is True
    assert (c["saved_eager_bytes"], c["saved_compiled_bytes"]) == (2003460, 1652276)  # see the test above


@pytest.mark.slow
@pytest.mark.parametrize("precision,recompute,regions,scope", [
    ("fp32", "none", 2, "block"), ("bf16", "full", 1, "block"), ("bf16", "none", 3, "block-loss")])
def test_per_block_compiled_trace_equals_a_real_compiled_step(precision, recompute, regions, scope):
    # --compile-scope block (torchtitan's apply_compile): each decoder block compiled alone, the rest
    # eager; block-loss (torchtune's compile_model + compile_loss): the loss function compiled alone too.
    # Under full recompute the second block reuses the first one's compiled graph (one partition);
    # without it Dynamo compiles each block (two); block-loss adds the loss's region
    step = StepSpec(batch=2, seq=64, precision=precision)
    impl = ImplSpec(device="cpu", optimizer_impl="foreach", compile=True, compile_scope=scope, recompute=recompute)
    fake = trace_step(config := LLAMA, step, impl)
    c = fake.meta["compile"]
    saved_bytes, peak_bytes, host_steps, real_regions = _real_compiled_step(config, step, impl)
    assert c["scope"] == scope and c["regions"] == real_regions == regions
    assert c["saved_compiled_bytes"] == saved_bytes
    assert fake.peak_logical_bytes - step.batch * step.seq * 8 + host_steps == peak_bytes
    if precision == "fp32" or scope == "block-loss":  # the arithmetic: tests/estimate/test_compiled_scope.py
        expected = (1692164, 38) if scope == "block" else (867860, 40)
        assert (c["saved_compiled_bytes"], c["saved_compiled_tensors"]) == expected


@pytest.mark.slow
def test_per_block_amp_bf16_trace_equals_a_real_compiled_forward():
    # amp-bf16 (fp32 weights, CPU autocast to bf16 around the step) with each block compiled alone:
    # the fake trace's compiled saved set == what autograd keeps in the same compiled model on real
    # tensors under torch.autocast (1504772 bytes, 53 tensors: tests/estimate/test_compiled_scope.py)
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import compile_model
    from trainmem.trace.saved import saved_tensors

    step = StepSpec(batch=2, seq=64, precision="amp-bf16")
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block")
    c = trace_step(LLAMA, step, impl).meta["compile"]
    torch.manual_seed(0)
    model = build_hf_model(LLAMA, attention="sdpa")
    model.train()
    runs, _ = compile_model(model, impl)
    ids = torch.randint(0, 1000, (2, 64))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return runs(ids, labels=ids).loss

    forward().backward()
    saved, out = saved_tensors(model, forward)
    del out
    assert (c["saved_compiled_bytes"], c["saved_compiled_tensors"]) == (sum(t.nbytes for t in saved), len(saved))
    assert (c["saved_compiled_bytes"], c["saved_compiled_tensors"]) == (1504772, 53)
