"""One result schema for every command (``trainmem.<command>/2``): the header and the vocabulary.

Every ``--json`` object starts with the same three keys, built here and nowhere else::

    {"schema": "trainmem.estimate/2", "trainmem_version": "0.1.0",
     "inputs": {"model": {"name": ..., "source": ..., <ModelSpec fields>} | null,
                "step": {...} | null, "impl": {...} | null, "parallel": {...} | null,
                "finetune": {...} | null, "gpu": {...} | null}, ...}

and speaks one vocabulary: ledger names are the inventory's categories (singular, in
``totals_bytes``, in items and in each phase's ``parts``), memory figures are named
``peak_<figure>_bytes`` with ``peak_bytes`` the allocated one, and phase names are :data:`PHASES`.
The JSON Schema of each command lies next to this file (``<command>.json``); docs/schema.md lists
what changed from ``/1``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from trainmem.inventory import Category

__all__ = ["VERSION", "COMMANDS", "LEDGERS", "FIGURES", "PHASES", "schema_name", "header", "model_source",
           "part_key", "figure_key", "set_inputs", "model_input", "trainmem_version", "schema_path"]

VERSION = 2
#: Result kinds, one per command, and ``variants``: ``profile --variants`` (one row per variant).
COMMANDS = ("estimate", "trace", "compare", "profile", "sweep", "plan", "advise", "explain", "snapshot", "variants")

#: Ledger names: the inventory's categories, singular everywhere (totals, items, phase parts).
LEDGERS: tuple[str, ...] = tuple(c.value for c in Category)

#: Memory figures; the JSON key of figure F's peak is ``peak_F_bytes``, except allocated: ``peak_bytes``.
FIGURES = ("allocated", "active", "reserved", "device")

#: Phase names shared by estimate (``phases[].name``), trace (``timeline.phases``, ``peak_phase``)
#: and profile. ``step_in_backward`` replaces ``optimizer`` under ``--optimizer-in-backward``;
#: ``other`` is a trace's time outside forward, backward and the optimizer (zero_grad, bookkeeping).
PHASES = ("forward", "backward_start", "head_backward", "backward", "backward_first_block", "backward_end", "optimizer",
          "step_in_backward", "prefill", "prefill_logits", "decode", "other")

# /1 phase parts used plural ledger names; /2 uses the singular categories
_PLURAL_PARTS = {f"{c.value}s": c.value for c in Category}


def part_key(name: str) -> str:
    """The /2 name of a phase part: a ledger's category (singular), any other part as it is."""
    return _PLURAL_PARTS.get(name, name)


def figure_key(figure: str) -> str:
    """The JSON key of a peak of ``figure`` (one of :data:`FIGURES`)."""
    if figure not in FIGURES:
        raise ValueError(f"figure={figure!r}: expected one of {', '.join(FIGURES)}")
    return "peak_bytes" if figure == "allocated" else f"peak_{figure}_bytes"


def schema_name(command: str) -> str:
    if command not in COMMANDS:
        raise ValueError(f"command={command!r}: expected one of {', '.join(COMMANDS)}")
    return f"trainmem.{command}/{VERSION}"


def schema_path(command: str) -> Path:
    """The JSON Schema (draft 2020-12) of ``command``'s ``--json``."""
    schema_name(command)
    return Path(__file__).with_name(f"{command}.json")


@lru_cache(maxsize=1)
def trainmem_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("trainmem")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def model_source(name: str) -> str:
    """Where a model named ``name`` was read from: ``preset``, ``file`` (a config.json), ``folder``
    (a model folder), ``hf_cache`` (an ORG/NAME in the local Hugging Face cache) or ``code`` (a
    spec or module built in Python)."""
    from trainmem.specs.loaders import list_presets
    if name in list_presets():
        return "preset"
    path = Path(name).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        return "file"
    org_name = name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".json")
    return "hf_cache" if org_name else "code"


def _model(model: Any) -> dict | None:
    if model is None:
        return None
    if isinstance(model, str):  # only a name is known (a traced custom module, a model class)
        return {"name": model, "source": model_source(model)}
    d = model.to_dict()
    return {"name": d.pop("name"), "source": model_source(model.name), **d}


def _spec(spec: Any) -> dict | None:
    if spec is None:
        return None
    return dict(spec) if isinstance(spec, dict) else spec.to_dict()


def model_input(source: Any, name: str) -> Any:
    """The model a command ran, for ``inputs.model``: a ModelSpec as it is, a ``config.json`` dict
    mapped onto one named ``name``; a model type trainmem does not map keeps the name only."""
    if not isinstance(source, dict):
        return source
    from trainmem.errors import TrainmemError
    from trainmem.specs.loaders import spec_from_hf_config
    try:
        return spec_from_hf_config(source, name=name)
    except TrainmemError:
        return name


def set_inputs(out: dict, **given: Any) -> dict:
    """Fill inputs a result was built without (the CLI resolves ``--gpu``, knows the model's spec);
    a None leaves the input as it was."""
    for key, value in given.items():
        if key not in _NORMALIZE:
            raise ValueError(f"input={key!r}: expected one of {', '.join(_NORMALIZE)}")
        if value is not None:
            out["inputs"][key] = _NORMALIZE[key](value)
    return out


def header(command: str, *, model: Any = None, step: Any = None, impl: Any = None, parallel: Any = None,
           finetune: Any = None, gpu: Any = None) -> dict:
    """The three keys every ``--json`` starts with. ``model``: a ModelSpec (or only its name);
    the others: a spec with ``to_dict()``, an already resolved dict, or None (does not apply)."""
    given = {"model": model, "step": step, "impl": impl, "parallel": parallel, "finetune": finetune, "gpu": gpu}
    return {"schema": schema_name(command), "trainmem_version": trainmem_version(),
            "inputs": {k: _NORMALIZE[k](v) for k, v in given.items()}}


_NORMALIZE = {"model": _model, "step": _spec, "impl": _spec, "parallel": _spec, "finetune": _spec, "gpu": _spec}
