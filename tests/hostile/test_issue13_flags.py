"""Issue 13's flags given values that cannot be right, on every command that takes them: one line
naming the value, exit 2. No silent default or ignored flag: ``--recompute every-k`` without K was K=1
(= full); an empty or repeated ``--offload`` item ran as if not given; ``--no-reshard-after-forward``
without FSDP or ZeRO-3, ``--fsdp-group`` without ``--fsdp hybrid`` and ``--float8-all-gather``
without FSDP, ``--freeze`` under LoRA/QLoRA, training options under ``--mode inference`` and
``--framework litgpt`` under ``--compile`` ran and changed nothing."""

from __future__ import annotations

import pytest

from hostile_helpers import assert_one_line_error

#: the estimate-backed commands that take --recompute/--offload, with what makes them cheap
COMMANDS = {
    "estimate": ["--seq", "64"],
    "advise": ["--seq", "64", "--gpu", "h100-80gb"],
    "sweep": ["--over", "seq", "--budget", "64MiB", "--max", "256"],
    "trace": ["--seq", "32"],
}


#: refused by the spec (trace checks them after building its model: transformers' import, seconds)
SPEC_CASES = [
    (["--recompute", "every-k"], "recompute_every=None: --recompute every-k needs --recompute-every K"),
    (["--recompute-every", "2"], "recompute_every=2: needs --recompute every-k, not none"),
    # sharding options given without the sharding they act under: each ran and changed nothing
    (["--dp", "2", "--no-reshard-after-forward"],
     "reshard_after_forward=False: --no-reshard-after-forward needs --fsdp"),
    (["--dp", "2", "--fsdp", "full", "--fsdp-group", "2"], "fsdp_group=2: --fsdp-group needs --fsdp hybrid, not full"),
    (["--dp", "2", "--float8", "tensorwise", "--float8-all-gather"],
     "float8_all_gather=True: --float8-all-gather needs --fsdp"),
    # under LoRA the base is frozen and every adapter trains: the patterns changed nothing
    (["--finetune", "lora", "--freeze", "layers.0-1"], "freeze='layers.0-1': --freeze needs --finetune full"),
]
#: refused by the parser, on every command
PARSER_CASES = [
    (["--offload", ""], "--offload='': an empty item"),
    (["--offload", "activations,"], "--offload='activations,': an empty item"),
    (["--offload", "activations,activations"], "--offload='activations,activations': a name repeated"),
]
CASES = [(c, f, m) for c in COMMANDS for f, m in PARSER_CASES + (SPEC_CASES if c != "trace" else [])]


@pytest.mark.parametrize("command, flags, message", CASES)
def test_refused_in_one_line(cli, tiny, command, flags, message):
    r = cli([command, "--model", tiny, *COMMANDS[command], *flags])
    assert_one_line_error(r)
    assert message in r.err


@pytest.mark.parametrize("flags, message", [
    (["--compile"], "compile=True: --compile is a training option"),
    (["--float8", "tensorwise"], "float8='tensorwise': --float8 is a training option"),
    (["--recompute", "full"], "recompute='full': --recompute is a training option"),
    (["--optimizer", "adamw8bit"], "optimizer='adamw8bit': --optimizer is a training option"),
    (["--optimizer-impl", "fused"], "optimizer_impl='fused': --optimizer-impl is a training option"),
    (["--optimizer-in-backward"], "optimizer_in_backward=True: --optimizer-in-backward is a training option"),
    (["--finetune", "lora"], "finetune='lora': fine-tuning options are training options"),
])
def test_training_flags_under_inference_are_refused(cli, tiny, flags, message):
    """estimate --mode inference ran each and printed the serving peak unchanged (llama-3-8b: 16,983,269,376 B)."""
    r = cli(["estimate", "--model", tiny, "--seq", "64", "--mode", "inference", *flags])
    assert_one_line_error(r)
    assert message in r.err


def test_compile_with_litgpt_blocks_is_refused(cli, tiny):
    """The compiled rules read transformers' blocks: --framework litgpt was dropped under --compile."""
    r = cli(["estimate", "--model", tiny, "--seq", "64", "--compile", "--framework", "litgpt"])
    assert_one_line_error(r)
    assert "framework='litgpt': --compile is modelled for transformers' modules" in r.err


@pytest.mark.parametrize("flags", [["--dp", "2", "--zero", "3", "--no-reshard-after-forward"],
                                   ["--dp", "2", "--fsdp", "hybrid", "--fsdp-group", "2"],
                                   ["--dp", "2", "--fsdp", "full", "--float8", "tensorwise", "--float8-all-gather"]])
def test_sharding_flags_with_their_sharding_run(cli, tiny, flags):
    r = cli(["estimate", "--model", tiny, "--seq", "64", *flags])
    assert r.rc == 0, r.err


def test_every_k_with_k_still_runs(cli, tiny):
    r = cli(["estimate", "--model", tiny, "--seq", "64", "--recompute", "every-k", "--recompute-every", "2", "--json"])
    assert r.rc == 0, r.err
    assert '"recompute_every": 2' in r.out


def test_plan_refuses_fsdp_bf16(cli, tiny):
    """plan searches ZeRO layouts only: under fsdp-bf16 it screened 0 configurations and printed
    "Nothing fits" over an empty table."""
    r = cli(["plan", "--model", tiny, "--seq", "64", "--gpus", "8", "--global-batch", "16", "--gpu", "h100-80gb",
             "--precision", "fsdp-bf16"])
    assert_one_line_error(r)
    assert "precision='fsdp-bf16': is FSDP2's MixedPrecisionPolicy, and plan searches ZeRO layouts" in r.err


def test_one_label_sequence_classification_is_refused(cli, tiny, tmp_path):
    """transformers runs a one-label seq-cls head as regression (MSELoss); the estimate priced the
    cross-entropy it models for two or more labels. Typed or from a classifier's config.json."""
    import json

    r = cli(["estimate", "--model", tiny, "--seq", "64", "--head", "seq-cls", "--num-labels", "1"])
    assert_one_line_error(r)
    assert "num_labels=1: a seq-cls head with one label is regression" in r.err
    cfg = json.loads(open(tiny).read()) | {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    path = tmp_path / "cls1.json"
    path.write_text(json.dumps(cfg))
    assert_one_line_error(cli(["estimate", "--model", path, "--seq", "64"]))
    assert cli(["estimate", "--model", tiny, "--seq", "64", "--head", "token-cls", "--num-labels", "1"]).rc == 0
