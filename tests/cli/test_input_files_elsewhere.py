"""--torchtune / --hf-args / --torchtitan and the other input files are read by estimate only; any
other command refuses them in one line that says so (exit 2), not a bare 'unrecognized arguments'."""

from __future__ import annotations

import pytest

from trainmem.cli import main


@pytest.mark.parametrize("argv", [["trace", "--torchtune", "r.yaml"], ["advise", "--gpu", "h100-80gb", "--hf-args=a.json"],
                                  ["plan", "--gpu", "h100-80gb", "--gpus", "8", "--torchtitan", "job.toml"]])
def test_other_commands_say_estimate_reads_the_files(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "unrecognized arguments" in err and "read by estimate only" in err


def test_other_unknown_flags_keep_argparses_words(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trace", "--no-such-flag"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "estimate only" not in err
