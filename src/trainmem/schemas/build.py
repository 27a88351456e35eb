"""Write the JSON Schema (draft 2020-12) of every command's ``--json`` from one description.

The header, the vocabulary (ledgers, phases) and the shapes shared by several commands (items,
phases, totals) are written once here; each ``<command>.json`` is generated and checked in, and
``tests/schema/test_schemas.py`` fails when a checked-in file differs from what this module builds.
Core keys are required; objects stay open (``additionalProperties``) so that a new field is additive.

    python -m trainmem.schemas.build   # rewrite src/trainmem/schemas/<command>.json
"""

from __future__ import annotations

import json
from pathlib import Path

from trainmem.fits import FIT_STATES
from trainmem.schemas import COMMANDS, PHASES, schema_name, schema_path
from trainmem.specs.impl import COMPILE_SCOPES

__all__ = ["build", "build_all", "write_all"]

BYTES = {"type": "integer", "minimum": 0}
BYTES_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
NUMBER_OR_NULL = {"type": ["number", "null"]}
SPEC = {"type": ["object", "null"]}


def _obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


# A ledger is an inventory category: singular snake_case. The rule, not the list, is written into the
# files, so a new category (trainmem.inventory.Category) needs no new schema; tests/schema checks
# that every category follows it, and a /1 plural ("parameters") does not.
LEDGER = {"type": "string", "pattern": "^[a-z][a-z0-9_]*[a-rt-z0-9_]$"}

DEFS = {
    "inputs": _obj({"model": {"oneOf": [{"type": "null"}, _obj({"name": {"type": "string"}, "source": {
                       "enum": ["preset", "file", "folder", "hf_cache", "code"]}})]},
                    "step": SPEC, "impl": SPEC, "parallel": SPEC, "finetune": SPEC, "gpu": SPEC}),
    "ledger_bytes": {"type": "object", "propertyNames": LEDGER,
                     "additionalProperties": BYTES},
    "item": _obj({"name": {"type": "string"}, "category": LEDGER, "bytes": BYTES},
                 {"shape": _array({"type": "integer", "minimum": 0}), "dtype": {"type": "string"},
                  "formula": {"type": "string"},
                  # the join key (trainmem.join): the name for model states, <module>:<bytes>B:<k> for activations
                  "key": {"type": "string"}}),
    "phase": _obj({"name": {"enum": list(PHASES)}, "bytes": BYTES,
                   "parts": {"type": "object", "additionalProperties": {"type": "integer"}}},
                  {"note": {"type": "string"}}),
    "phase_name": {"enum": list(PHASES)},
    # the three-state answer to "does it fit" (trainmem.fits.FIT_STATES), wherever a result decides fit
    "fit_state": {"enum": list(FIT_STATES)},
}
REF = {k: {"$ref": f"#/$defs/{k}"} for k in DEFS}

_PEAK = {"peak_bytes": BYTES, "peak_phase": REF["phase_name"]}
# the ``--gpu`` verdict (trainmem.fits.Verdict.to_dict), wherever a command prints one
_FITS = _obj({"fits": {"type": "boolean"}, "fit_state": REF["fit_state"]})
_TENSOR_SIDE = {"oneOf": [{"type": "null"}, _obj({"name": {"type": "string"}, "dtype": {"type": "string"},
                                                  "bytes": BYTES})]}  # compare's per-tensor join, one side

BODIES: dict[str, tuple[dict, dict]] = {  # command: (required, optional)
    "estimate": ({"profile": {"type": "string"}, "totals_bytes": REF["ledger_bytes"], **_PEAK,
                  "phases": _array(REF["phase"]), "notes": _array({"type": "string"})},
                 {"items": _array(REF["item"]), "peak_rank": {"type": "string"},
                  "fits": _FITS,
                  # --compile: both saved sets, under trace's meta.compile keys (estimate/rules_compiled_report.py)
                  "compile": _obj({"scope": {"enum": list(COMPILE_SCOPES)}, "saved_eager_bytes": BYTES,
                                   "saved_compiled_bytes": BYTES}),
                  "ranks": _array(_obj({"name": {"type": "string"}, "count": {"type": "integer"}, **_PEAK,
                                        "totals_bytes": REF["ledger_bytes"], "phases": _array(REF["phase"])}))}),
    "trace": ({"meta": {"type": "object"}, "peak_bytes": BYTES, "peak_logical_bytes": BYTES,
               "peak_phase": {"enum": [*PHASES, ""]}, "peak_op": {"type": "string"},
               "peak_module": {"type": "string"}, "peak_reserved_bytes": BYTES,
               "peak_reserved_expandable_bytes": BYTES, "fragmentation": {"type": "number"},
               "num_allocations": {"type": "integer"}, "totals_at_peak_bytes": REF["ledger_bytes"],
               "modules": _array(_obj({"name": {"type": "string"}, "forward_peak_bytes": BYTES,
                                       "backward_peak_bytes": BYTES})),
               "top_at_peak": _array(REF["item"]), "items": _array(REF["item"])},
              {"fits": _FITS, "timeline": _obj({"index": _array({"type": "integer"}), "allocated_bytes": _array(BYTES),
                                 "reserved_bytes": _array(BYTES),
                                 "phases": _array({"type": "array", "prefixItems": [{"type": "integer"},
                                                                                    REF["phase_name"]]})})}),
    "compare": ({"rows": _array(_obj({"name": {"type": "string"}, "estimate_bytes": BYTES, "trace_bytes": BYTES,
                                      "ratio": NUMBER_OR_NULL})),
                 "activations": _obj({"estimate_bytes": BYTES, "trace_bytes": BYTES, "ratio": NUMBER_OR_NULL}),
                 "peak": _obj({"estimate_bytes": BYTES, "trace_bytes": BYTES, "ratio": NUMBER_OR_NULL,
                               "estimate_phase": REF["phase_name"], "trace_phase": {"enum": [*PHASES, ""]}})},
                {"tensors": _array(_obj({"key": {"type": "string"}, "estimate": _TENSOR_SIDE, "trace": _TENSOR_SIDE,
                                         "equal": {"type": "boolean"}}))}),
    "profile": ({"meta": {"type": "object"}, "device": {"type": "string"}, "peak_bytes": BYTES,
                 "peak_reserved_bytes": BYTES_OR_NULL, "tokens_per_s": NUMBER_OR_NULL,
                 "totals_bytes": {"type": "object", "additionalProperties": {"type": "integer"}},
                 # the first micro-batch's activations, keyed as estimate's and trace's (trainmem.measure.tensors)
                 "items": _array(REF["item"]),
                 "ranks": _array(_obj({"rank": {"type": "integer"}, "device": {"type": "string"}, "peak_bytes": BYTES,
                                       "peak_reserved_bytes": BYTES_OR_NULL, "peak_active_bytes": BYTES_OR_NULL},
                                      {"items": _array(REF["item"])}))},
                {"fits": _FITS}),
    "sweep": ({"search": {"type": "object"}, "over": {"enum": ["seq", "batch"]}, "backend": {"type": "string"},
               "budget_bytes": BYTES, "max_fit": {"type": ["integer", "null"]}, "capped": {"type": "boolean"},
               "points": _array(_obj({"value": {"type": "integer"}, "fits": {"type": "boolean"},
                                      "fit_state": REF["fit_state"],
                                      "peak_bytes": BYTES_OR_NULL, "peak_reserved_bytes": BYTES_OR_NULL,
                                      "totals_bytes": {"type": "object"}})),
               "fit": {"type": "object"}, "verdict": {"type": "string"}},
              # the second bound (measure.sweeps.bisect_max_runs): runs, possibly only by flushing the cache
              {"max_fit_with_flush": {"type": ["integer", "null"]}, "capped_with_flush": {"type": "boolean"},
               "fits": _FITS, "fits_next": _FITS, "fits_with_flush": _FITS}),
    "plan": ({"reserve": _obj({"usable_bytes": BYTES}),
              "candidates": _array(_obj({"config": {"type": "object"}, "peak_bytes": BYTES, "fits": {"type": "boolean"},
                                         "fit_state": REF["fit_state"], "tokens_per_s": NUMBER_OR_NULL})),
              "pareto": _array({"type": "object"}), "search": {"type": "object"}}, {}),
    "advise": ({"usable_bytes": BYTES, "start_peak_bytes": BYTES, "start_command": {"type": "string"},
                "options": _array({"type": "object"}), "steps": _array({"type": "object"}),
                "skipped": _array(_obj({"rung": {"type": "string"}, "why": {"type": "string"}})),
                "fits": {"type": "boolean"}, "fit_state": REF["fit_state"]}, {}),
    "explain": ({"notes": _array({"type": "string"}), "answers": _array({"type": "object"})}, {}),
    "variants": ({"device": {"type": "string"},
                  "rows": _array(_obj({"label": {"type": "string"}, "peak_bytes": BYTES_OR_NULL,
                                       "peak_reserved_bytes": BYTES_OR_NULL, "tokens_per_s": NUMBER_OR_NULL,
                                       "status": {"type": "string"}}))}, {}),
    "snapshot": ({"num_segments": {"type": "integer"}, "reserved_bytes": BYTES, "allocated_bytes": BYTES,
                  "peak_bytes": BYTES, "num_events": {"type": "integer"},
                  "top_allocations": _array(_obj({"size_bytes": BYTES, "where": {"type": "string"}}))}, {}),
}


def build(command: str) -> dict:
    """The JSON Schema of ``command``'s ``--json``: the header, then its core keys."""
    required, optional = BODIES[command]
    body = _obj({"schema": {"const": schema_name(command)}, "trainmem_version": {"type": "string"},
                 "inputs": REF["inputs"], **required}, optional)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://trainmem.dev/schemas/{command}.json", "title": f"trainmem {command} --json",
            **body, "$defs": DEFS}


def build_all() -> dict[str, dict]:
    return {c: build(c) for c in COMMANDS}


def dumps(schema: dict) -> str:
    return json.dumps(schema, indent=1) + "\n"


def write_all() -> list[Path]:
    out = []
    for command, schema in build_all().items():
        path = schema_path(command)
        path.write_text(dumps(schema), encoding="utf-8")
        out.append(path)
    return out


if __name__ == "__main__":  # pragma: no cover
    for p in write_all():
        print(p)
