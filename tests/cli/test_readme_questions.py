"""Each question of issue 15's opening list is answered by the one command the README shows for it.

The commands are read from README.md's table and run exactly as written (through
``trainmem.cli.main``); the test checks that each prints its answer.
"""

import re
import shlex
from pathlib import Path

import pytest

from trainmem.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| (?P<question>[^|]+?) \| `(?P<command>trainmem [^`]+)` \|")

#: question -> what its answer looks like in the text output
ANSWERS = {
    "Does it fit on my GPU?": r"^(FITS|FITS ONLY BY FLUSHING THE ALLOCATOR CACHE|DOES NOT FIT) on 1× H100-80GB: needs "
                              r"[\d.]+ GiB allocated [^\n]*\n?[^\n]*(headroom|short by) ",
    "What is the cheapest change?": r"^Cheapest changes that fit .*\n1\. .*\n   peak [\d.]+ GiB allocated, [\d.]+ GiB reserved, headroom .*\n   trainmem estimate ",
    "What is the largest batch for LoRA on a 24 GB card?": r"^largest batch within [\d.]+ GiB \(estimate\): [1-9]\d* sequences",
    "How many H100s do I need?": r"^Smallest GPU count that fits: \d+ × H100-80GB \(tried 1: ",
    "How much memory does serving need?": r"^Peak: [\d.]+ GiB allocated .*\n(.*\n)*fits [\d,]+ concurrent sequences of 8,192 tokens",
}
SLOW = {"What is the cheapest change?", "How many H100s do I need?"}  # the advisor's and the planner's searches


def readme_questions() -> dict[str, str]:
    rows = {}
    section = README.read_text().split("## Five questions, one command each", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            rows[m["question"]] = m["command"]
    return rows


def test_the_readme_answers_each_question_once():
    assert list(readme_questions()) == list(ANSWERS)


@pytest.mark.parametrize("question", [pytest.param(q, marks=pytest.mark.slow) if q in SLOW else q for q in ANSWERS])
def test_the_readme_command_prints_the_answer(capsys, question):
    argv = shlex.split(readme_questions()[question])
    assert argv[0] == "trainmem"
    rc = main(argv[1:])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert re.search(ANSWERS[question], out, re.MULTILINE), out
