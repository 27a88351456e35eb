"""A page's JSON request, turned into the command line ``trainmem estimate`` would be given and
parsed by the same option definitions (:mod:`trainmem.cliargs`, the GPU options of
``trainmem advise``), so a bad value fails with the CLI's own one-line message.

A request is a flat JSON object whose keys are the options' names with ``_`` for ``-``
(``{"model": "llama-3-8b", "batch": 4, "recompute": "full", "tp": 2, "sp": true}``), plus
``gpu`` and ``gpus``. ``null`` leaves an option at its default. The data-parallel degree is not a
key: it is ``gpus / (tp × cp × pp)``.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from functools import lru_cache

from trainmem.errors import RequestError, SpecError

__all__ = ["RequestError", "Request", "parse_request", "request_parser", "DEFAULT_GPU"]

DEFAULT_GPU = "H100-80GB"
#: option groups in the order their flags are written; ``estimate`` and ``step`` flags go to
#: ``trainmem estimate``, ``step`` and ``gpu`` flags to ``trainmem advise``
GROUPS = ("step", "estimate", "gpu")


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):  # the CLI prints this line and exits 2; here it is the 400
        raise RequestError(message)


@dataclass(frozen=True)
class _Parser:
    parser: argparse.ArgumentParser
    group_of: dict[str, str]             # dest -> group
    actions: dict[str, argparse.Action]  # dest -> action


def _build() -> _Parser:
    from trainmem.cliargs import add_finetune_args, add_model_step_args, add_parallel_args, positive_int
    from trainmem.plan.gpu_args import add_gpu_args

    p = _Refusing(prog="trainmem serve", add_help=False)
    group_of: dict[str, str] = {}

    def added(group: str) -> None:
        for a in p._actions:
            group_of.setdefault(a.dest, group)

    add_model_step_args(p)
    added("step")
    add_parallel_args(p)
    add_finetune_args(p)
    added("estimate")
    add_gpu_args(p, required=False, reserved_figure=True)  # plan's and advise's fit (issue 13 item 8)
    p.add_argument("--gpus", type=positive_int("gpus"), default=1, help="GPUs (data parallel = gpus / (tp × cp × pp))")
    p.set_defaults(gpu=DEFAULT_GPU)
    added("gpu")
    actions = {a.dest: a for a in p._actions if a.option_strings and a.dest != "dp"}
    return _Parser(p, group_of, actions)


@lru_cache(maxsize=1)
def request_parser() -> _Parser:
    """The request's fields: the CLI's options, built once."""
    return _build()


@dataclass(frozen=True)
class Request:
    """A parsed request: the argparse namespace the CLI would have built, and the flags typed."""

    args: argparse.Namespace
    estimate_argv: tuple[str, ...]  # for trainmem estimate
    advise_argv: tuple[str, ...]    # for trainmem advise (model and step flags, GPU flags)

    def command(self, name: str) -> str:
        argv = self.estimate_argv if name == "estimate" else self.advise_argv
        return shlex.join(["trainmem", name, *argv])


def _flag(dest: str, value: object, action: argparse.Action) -> list[str]:
    flag = action.option_strings[-1]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise RequestError(f"{dest}={value!r}: must be true or false")
        return [flag] if value else []
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RequestError(f"{dest}={value!r}: must be a string or a number")
    return [f"{flag}={value}"]  # one token: a value starting with '-' is not read as a flag


def parse_request(body: object) -> Request:
    """The namespace for ``body`` (a decoded JSON object), through the CLI's option parsers."""
    if not isinstance(body, dict):
        raise RequestError(f"request must be a JSON object, not {type(body).__name__}")
    p = request_parser()
    argv: dict[str, list[str]] = {g: [] for g in GROUPS}
    for key, value in body.items():
        if key == "dp":
            raise RequestError("dp: not a field: the data-parallel degree is gpus / (tp × cp × pp); set gpus")
        action = p.actions.get(key)
        if action is None:
            raise RequestError(f"unknown field {key!r} (fields: {', '.join(p.actions)})")
        if value is not None:
            argv[p.group_of[key]] += _flag(key, value, action)
    args = p.parser.parse_args([*argv["step"], *argv["estimate"], *argv["gpu"]])
    replica = (args.tp or 1) * (args.cp or 1) * (args.pp or 1)
    if args.gpus % replica:
        raise SpecError("gpus", args.gpus, f"must be a multiple of tp × cp × pp = {replica}")
    args.dp = args.gpus // replica
    dp = [f"--dp={args.dp}"] if args.dp > 1 else []
    gpu = [f"--gpu={args.gpu}", *(a for a in argv["gpu"] if not a.startswith(("--gpu=", "--gpus="))),
           *([f"--gpus={args.gpus}"] if args.gpus > 1 else [])]
    return Request(args, tuple(argv["step"] + argv["estimate"] + dp), tuple(argv["step"] + gpu))
