"""``--float8`` on a model torchao converts nothing in (GPT-2: ``Conv1D`` blocks, not ``nn.Linear``; its head
filtered) says so in a note, and the estimate is the unconverted step's (estimate/notes.py ``float8_noop``).
A model with converted linears carries no such note."""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model


def test_gpt2_float8_converts_nothing_and_says_so():
    step = StepSpec(batch=1, seq=128, precision="bf16")
    gpt2 = load_model("gpt2")
    for recipe in ("tensorwise", "rowwise"):
        e = estimate(gpt2, step, ImplSpec(float8=recipe))
        assert any(n.startswith(f"--float8 {recipe} converts nothing") for n in e.notes), e.notes
        assert e.peak_bytes == estimate(gpt2, step, ImplSpec()).peak_bytes
    assert not any("float8" in n for n in estimate(gpt2, step, ImplSpec()).notes)


def test_llama_float8_has_no_such_note():
    e = estimate(load_model("llama-3-8b"), StepSpec(batch=1, seq=128, precision="bf16"), ImplSpec(float8="tensorwise"))
    assert not any("converts nothing" in n for n in e.notes)
