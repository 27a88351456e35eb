"""A trace does not depend on what ran before it in the process.

Helper resid2 reported a NeoX full fine-tuning trace at B1 S32 (selective recompute) holding the caller's ids in
the optimizer phase in a fresh process but not after a LoRA trace in the same process. At HEAD (and before aaadcfa)
the peaks, phases and the optimizer phase's live bytes of both runs are equal; what did differ between processes
was the order of the frees ``torch.clear_autocast_cache`` makes (its map is keyed by ``TensorImpl*``,
aten/src/ATen/autocast_mode.cpp), which moved points of the amp-bf16 timeline. The recorder now records those
frees in allocation order (trace/autocast_order.py), and the whole result of a trace is asserted equal to a fresh
process's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.trace import trace, trace_step  # noqa: E402

CONFIGS = {
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=256, max_position_embeddings=512),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}

# one trace, its whole result as JSON on stdout: run in a fresh interpreter
FRESH = textwrap.dedent("""
    import json, sys
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.trace import trace_step
    config, precision, mode, recompute = json.loads(sys.argv[1])
    finetune = FinetuneSpec(mode="lora", lora_rank=8) if mode == "lora" else None
    result = trace_step(config, StepSpec(batch=1, seq=32, precision=precision, optimizer="adamw"),
                        ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=finetune)
    print(json.dumps(result.to_dict()))
""")


def _traced(config: dict, precision: str, mode: str, recompute: str = "selective") -> dict:
    from trainmem.specs.finetune import FinetuneSpec
    finetune = FinetuneSpec(mode="lora", lora_rank=8) if mode == "lora" else None
    result = trace_step(config, StepSpec(batch=1, seq=32, precision=precision, optimizer="adamw"),
                        ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=finetune)
    return json.loads(json.dumps(result.to_dict()))


def _fresh(config: dict, precision: str, mode: str, recompute: str = "selective") -> subprocess.Popen:
    """The trace in a fresh interpreter, started now (it runs while this process traces); :func:`_read` waits."""
    return subprocess.Popen([sys.executable, "-c", FRESH, json.dumps([config, precision, mode, recompute])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def _optimizer_peak(d: dict) -> int:
    timeline, phases = d["timeline"]["allocated_bytes"], d["timeline"]["phases"]
    bounds = [i for i, _ in phases] + [len(timeline)]
    return max(max(timeline[a:b]) for (a, p), b in zip(phases, bounds[1:]) if p == "optimizer" and b > a)


def test_autocast_cache_frees_recorded_in_allocation_order():
    """Linear layers under CPU autocast: each bias's bf16 copy is cached (a leaf that requires grad) and not saved
    for backward, so all die in autocast's exit, in the hash map's order; they are recorded in the layers' order."""
    widths = [8, 24, 40, 16, 56, 32, 72, 48]  # distinct, so each copy's logical bytes name its layer
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    x = torch.randn(2, widths[0])
    clear = torch.clear_autocast_cache
    with trace(model, inputs=[x]) as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
    rec = t.result.recording
    backward_at = next(i for i, p in rec.marks if p == "backward")
    # the casts that die in autocast's exit: the bias copies, and the first layer's weight copy (its input needs
    # no gradient, so backward does not save the weight)
    casts = [rec.blocks[~e] for e in rec.events[:backward_at] if e < 0 and rec.blocks[~e].op == "_to_copy"
             and rec.blocks[~e].dtype == "bfloat16"]
    assert [b.nbytes for b in casts if len(b.shape) == 1] == [2 * w for w in widths[1:]]  # bf16: 2 B a value
    assert [b.shape for b in casts if len(b.shape) == 2] == [(widths[1], widths[0])]
    assert [b.id for b in casts] == sorted(b.id for b in casts)  # in the order they were cast
    assert [b.free_at for b in casts] == list(range(casts[0].free_at, casts[0].free_at + len(casts)))  # one run
    assert torch.clear_autocast_cache is clear  # torch's own again after the trace


@pytest.mark.slow
def test_lora_then_full_equals_a_fresh_process():
    """resid2's case at amp-bf16: the full fine-tuning trace after a LoRA trace is a fresh process's, byte for byte
    and event for event (the timeline included)."""
    config = CONFIGS["gpt_neox"]
    fresh = _fresh(config, "amp-bf16", "full")
    _traced(config, "amp-bf16", "lora")
    after = _traced(config, "amp-bf16", "full")
    fresh = _read(fresh)
    # the caller's ids (B·S·8 = 1·32·8 = 256 B, one 512-B block) are alive through the optimizer step in both
    assert after["peak_phase"] == fresh["peak_phase"] == "optimizer"
    assert _optimizer_peak(after) == _optimizer_peak(fresh)
    assert after == fresh


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,first,second,recompute", [
    ("gpt_neox", "fp32", "lora", "full", "selective"),
    ("gpt_neox", "amp-bf16", "full", "lora", "selective"),
    ("gpt_neox", "amp-bf16", "lora", "full", "full"),  # each checkpoint's recompute clears the cache too
    ("llama", "amp-bf16", "lora", "full", "selective"),
    ("llama", "fp32", "full", "lora", "selective"),
])
def test_second_trace_equals_a_fresh_process(family, precision, first, second, recompute):
    config = CONFIGS[family]
    fresh = _fresh(config, precision, second, recompute)
    _traced(config, precision, first, recompute)
    assert _traced(config, precision, second, recompute) == _read(fresh)
