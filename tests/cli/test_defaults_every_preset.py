"""Every estimate-backed command runs at its defaults on every bundled preset, and the library
and the command line share one set of defaults (issue 12, items 4 and 7)."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.specs import StepSpec
from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, list_presets, load_config_dict, load_model
from trainmem.specs.presets import estimated_presets
from trainmem.specs.step import DEFAULT_SEQ, default_seq

PRESETS = estimated_presets()  # the hand-written hf rules cover them
#: presets whose model type only --profile traced and trace cover (none today; deepseek_v3 runs the MLA rules)
TRACED = sorted(set(list_presets()) - set(PRESETS))

#: command -> (the arguments it requires, a line its text output must hold). Nothing else is given.
COMMANDS = {
    "estimate": ((), "Peak:"),
    "explain": ((), "Q: What happens when the sequence length doubles?"),
    "advise": (("--gpu", "h100-80gb"), "trainmem advise"),
    "sweep": (("--over", "seq", "--budget", "80GiB", "--backend", "estimate"), "verdict:"),
    "plan": (("--gpu", "h100-80gb", "--gpus", "1", "--global-batch", "1"), "trainmem plan"),
}


def _smallest_of_each_model_type() -> set[str]:
    smallest: dict[str, tuple[int, str]] = {}
    for p in PRESETS:
        m, model_type = load_model(p), load_config_dict(p)["model_type"]
        smallest[model_type] = min(smallest.get(model_type, (m.hidden_size * m.num_layers, p)),
                                   (m.hidden_size * m.num_layers, p))
    return {p for _, p in smallest.values()}


#: the default run: estimate on every preset, every command on the smallest preset of each model type
#: (the same rules and layer kinds); the other presets' explain/sweep/advise/plan runs (1-17 s each on
#: two shared cores: advise and plan search the layouts) are in the slow set, which CI also runs
EVERY_COMMAND = _smallest_of_each_model_type() | set(TRACED)
CASES = [pytest.param(preset, command, id=f"{preset}-{command}",
                      marks=() if command == "estimate" or preset in EVERY_COMMAND else pytest.mark.slow)
         for command in COMMANDS for preset in PRESETS + TRACED]


def test_presets_include_models_shorter_than_the_default_sequence():
    short = {p: load_model(p).max_positions for p in PRESETS if 0 < load_model(p).max_positions < DEFAULT_SEQ}
    assert {"gpt2", "bert-large"} <= set(short), short


@pytest.mark.parametrize("preset,command", CASES)
def test_command_runs_at_its_defaults(preset, command, capsys):
    """A preset the hf rules cover runs; any other is refused in one line that names the missing
    piece (rules for its model type or layer kinds) and points at --profile traced / trace."""
    required, needle = COMMANDS[command]
    rc = main([command, "--model", preset, *required])
    out, err = capsys.readouterr()
    if preset in TRACED:
        model_type = load_config_dict(preset)["model_type"]
        assert (rc, out) == (2, "")
        assert err.count("\n") == 1 and err.split(":")[0] in ("UnsupportedError", "SpecError"), err
        assert model_type in err and "--profile traced" in err
        if model_type not in SUPPORTED_MODEL_TYPES:
            assert "trainmem estimate --profile traced" in err and "trainmem trace" in err
        return
    assert rc == 0, err
    assert err == ""
    assert needle in out
    assert preset in out.splitlines()[0] or command in ("sweep",), out.splitlines()[0]


def test_deepseek_presets_run_the_hf_rules_at_defaults():
    """MLA on CUDA is modelled (issue 14: SDPA's memory-efficient kernel), so DeepSeek presets are not
    refused at the default device: test_command_runs_at_its_defaults requires exit 0 for them."""
    deepseek = [p for p in list_presets() if p.startswith("deepseek")]
    assert deepseek and set(deepseek) <= set(PRESETS), deepseek


@pytest.mark.parametrize("preset", ["llama-3-8b", "gpt2", "bert-large"])
def test_library_and_cli_defaults_agree(preset, capsys):
    model = load_model(preset)
    assert main(["estimate", "--model", preset, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    lib = json.loads(json.dumps(estimate(model).to_dict()))  # tuples become lists, as in the CLI's JSON
    assert cli == lib
    step = lib["inputs"]["step"]
    # llama-3-8b: rotary, no learned positions -> 4096; gpt2: 1024 positions; bert-large: 512
    assert step["seq"] == {"llama-3-8b": 4096, "gpt2": 1024, "bert-large": 512}[preset]
    assert step["precision"] == "bf16"
    assert step["seq"] == default_seq(model.max_positions)


def test_stepspec_defaults_are_the_cli_defaults():
    from trainmem.cli import build_parser

    args = build_parser().parse_args(["estimate"])
    s = StepSpec()
    assert (s.batch, s.seq, s.grad_accum, s.precision, s.optimizer, s.loss) == (1, DEFAULT_SEQ, 1, "bf16", "adamw", "ce")
    for field in ("batch", "grad_accum", "precision", "optimizer", "loss"):
        assert getattr(args, field).value == getattr(s, field), field  # marked defaults (trainmem.inputs)
    assert args.seq.value is None  # resolved per model by default_seq


def test_default_seq_is_clipped_to_learned_positions():
    assert default_seq(0) == DEFAULT_SEQ == 4096  # rotary models: no learned positions
    assert default_seq(1024) == 1024
    assert default_seq(8192) == 4096


def test_explain_doubles_half_the_sequence_at_the_position_limit():
    from trainmem.plan.explain import explain
    from trainmem.specs import ImplSpec

    gpt2 = load_model("gpt2")
    answers = {a.key: a for a in explain(gpt2, StepSpec(seq=1024), ImplSpec()).answers}
    doubling = answers["sequence_doubles"]
    assert (doubling.numbers["seq"], doubling.numbers["seq_doubled"]) == (512, 1024)
    assert doubling.numbers["activation_bytes"][1] == estimate(gpt2, StepSpec(seq=1024)).totals_bytes["activation"]
    assert "1024 learned positions, too few to double S=1024" in doubling.answer
