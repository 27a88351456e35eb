"""``--recompute-from kth|first``: which blocks ``--recompute every-k`` checkpoints, on every command that takes
``--recompute`` (the shared ``cliargs.add_model_step_args``; trace builds its ImplSpec itself).

``kth`` (the default) is torchtitan's and torchtune's 1-based counter (blocks K-1, 2K-1, ...), ``first`` transformers'
``every_n_layers`` (0, K, 2K, ...: what ``--hf-args`` reads). Before the option, an every-k read off a Trainer's
arguments printed ``recompute=every-k(K=2, from=first)`` and a command that, re-typed, counted torchtitan's way."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main

STEP = ["--batch", "2", "--seq", "96", "--precision", "fp32", "--optimizer", "adamw", "--attention", "sdpa",
        "--device", "cpu"]


def _config(tmp_path, layers: int) -> str:
    path = tmp_path / f"llama{layers}.json"
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=176,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=128)))
    return str(path)


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys, argv: list[str]) -> dict:
    rc, out, err = _run(capsys, [*argv, "--json"])
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("command,more", [("estimate", []), ("advise", ["--gpu", "h100-80gb"]), ("explain", []),
                                          ("compare", []), ("trace", [])])
def test_recompute_from_needs_every_k(capsys, tmp_path, command, more):
    rc, _, err = _run(capsys, [command, "--model", _config(tmp_path, 4), *more, "--recompute", "full",
                               "--recompute-from", "first"])
    assert rc == 2
    assert err.strip() == "SpecError: recompute_from='first': --recompute-from needs --recompute every-k, not full"


def test_recompute_from_reaches_the_spec_and_the_header(capsys, tmp_path):
    every = ["--model", _config(tmp_path, 4), *STEP, "--recompute", "every-k", "--recompute-every", "2"]
    assert _json(capsys, ["estimate", *every])["inputs"]["impl"]["recompute_from"] == "kth"
    first = _json(capsys, ["estimate", *every, "--recompute-from", "first"])
    assert first["inputs"]["impl"]["recompute_from"] == "first"
    rc, out, _ = _run(capsys, ["estimate", *every, "--recompute-from", "first"])
    assert rc == 0 and "recompute=every-k(K=2, from=first)" in out


def test_hf_args_every_n_layers_is_the_typed_first(capsys, tmp_path):
    """A Trainer's ``every_n_layers=2`` (blocks 0 and 2 of 4) and the option typed as the header names it give one
    peak; torchtitan's count (blocks 1 and 3) another: 2 blocks checkpointed either way, the last one's
    recomputation read beside a different set of kept blocks."""
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 2},
                                "per_device_train_batch_size": 2}))
    base = ["estimate", "--model", _config(tmp_path, 4), *STEP[2:]]
    read = _json(capsys, [*base, "--batch", "2", "--hf-args", str(args)])
    assert (read["inputs"]["impl"]["recompute"], read["inputs"]["impl"]["recompute_from"]) == ("every-k", "first")
    typed = _json(capsys, [*base, "--batch", "2", "--recompute", "every-k", "--recompute-every", "2",
                           "--recompute-from", "first"])
    kth = _json(capsys, [*base, "--batch", "2", "--recompute", "every-k", "--recompute-every", "2"])
    assert read["peak_bytes"] == typed["peak_bytes"] != kth["peak_bytes"]


@pytest.mark.slow  # eight fake-tensor traces of the tiny model, ~2-3 s each
@pytest.mark.parametrize("layers,k", [(4, 2), (4, 3), (5, 2), (5, 3)])
def test_estimate_equals_trace_for_both_placements(capsys, tmp_path, layers, k):
    """Both counts, estimate == trace to the byte (fp32 B2 S96, CPU kernels): kth checkpoints blocks k-1, 2k-1, ...
    (L=4, k=3: block 2 only), first blocks 0, k, 2k (L=5, k=2: blocks 0, 2, 4)."""
    cfg = _config(tmp_path, layers)
    peaks = {}
    for start in ("kth", "first"):
        flags = ["--model", cfg, *STEP, "--recompute", "every-k", "--recompute-every", str(k),
                 "--recompute-from", start]
        e, t = _json(capsys, ["estimate", *flags]), _json(capsys, ["trace", *flags])
        assert t["inputs"]["impl"]["recompute_from"] == start
        assert e["peak_bytes"] == t["peak_logical_bytes"], (start, e["peak_bytes"], t["peak_logical_bytes"])
        peaks[start] = e["peak_bytes"]
    assert len(set(peaks.values())) == 2, peaks  # the two counts checkpoint other blocks: other peaks
