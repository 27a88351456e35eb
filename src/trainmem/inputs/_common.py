"""What every reader shares: reading a small text file safely, TOML/JSON parsing that fails in
one line, the spec sections and their field types, and the shape of a reader's answer.

A reader answers with a plain dict::

    {"source": "deepspeed", "path": "ds.json",
     "raw": {...the values it read, under the file's own key paths...},
     "overrides": {"step": {"batch": 4}, "parallel": {"zero": 3}},   # spec field names
     "notes": ["..."]}                                                 # what was approximated
"""

from __future__ import annotations

import difflib
import json
import stat
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from trainmem.errors import ConfigError
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_FILE_BYTES = 1 << 20  # a config larger than 1 MiB is not a config

#: Spec classes by section name, in the order specs are built.
SECTIONS: dict[str, type] = {"model": ModelSpec, "step": StepSpec, "impl": ImplSpec, "parallel": ParallelSpec}


def field_types(section: str) -> dict[str, str]:
    """Field name -> annotation text (``"int"``, ``"bool"``, ``"str | None"``...) of one spec."""
    return {f.name: str(f.type) for f in fields(SECTIONS[section])}


def unknown_key(where: str, key: str, known) -> ConfigError:
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; known: {', '.join(known)}")


def check_type(where: str, key: str, value: Any, annotation: str) -> Any:
    """``value`` converted to what the spec field expects (lists become tuples), or ConfigError."""
    ann = annotation.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann[: -len("|None")] if optional else ann
    if value is None and optional:
        return None
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base.startswith("tuple["):
        ok = isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
        base = "list"
    else:  # str, Literal[...]
        ok = isinstance(value, str)
        base = "string"
    if not ok:
        raise ConfigError(f"{where}: {key}={value!r} must be {'a ' if base != 'int' else 'an '}{base}")
    return value


def read_text(path: str | Path, what: str) -> str:
    p = Path(path).expanduser()
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):  # /dev/zero never ends, a FIFO blocks on open
            raise ConfigError(f"{path}: not a regular file, expected a {what} file")
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # the file may grow after stat
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: {what} larger than {MAX_FILE_BYTES >> 20} MiB, not read")
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, expected a {what} file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None


def load_toml(path: str | Path, what: str) -> dict:
    text = read_text(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: TOML nested too deeply") from None


def load_mapping(path: str | Path, what: str, fmt: str, parse: Callable[[str], Any]) -> dict:
    """The one shape of every config reader: the file read whole (:func:`read_text`), parsed by
    ``parse`` (which raises ConfigError naming the position of a syntax error), a nesting that
    exhausts the parser refused, and anything but a mapping at the top refused."""
    text = read_text(path, what)
    try:
        data = parse(text)
    except RecursionError:
        raise ConfigError(f"{path}: {fmt} nested too deeply") from None
    if not isinstance(data, dict):
        noun = "object" if fmt == "JSON" else "mapping"
        raise ConfigError(f"{path}: expected a {fmt} {noun}, got a {type(data).__name__}")
    return data


def load_json(path: str | Path, what: str) -> dict:
    """A JSON object from ``path`` (:func:`load_mapping`)."""
    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return load_mapping(path, what, "JSON", parse)


def table(data: dict, key: str, where: str) -> dict:
    """``data[key]`` when it is a table (missing -> {}), else ConfigError."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table, got {type(value).__name__} {value!r:.40}")
    return value


def typed(where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is of ``kind`` (bools are not ints), else ConfigError naming the key."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}: {key}={value!r:.60} must be {names}")
    return value


def positive_int(where: str, key: str, value: Any) -> int:
    typed(where, key, value, int)
    if value <= 0:
        raise ConfigError(f"{where}: {key}={value} must be positive")
    return value


def answer(source: str, path: str, raw: dict, overrides: dict, notes: list[str]) -> dict:
    return {"source": source, "path": str(path), "raw": raw,
            "overrides": {k: v for k, v in overrides.items() if v}, "notes": notes}


def merge_overrides(answers: list[dict]) -> tuple[dict[str, dict], dict[str, str]]:
    """One overrides dict from several readers' answers, and which source set each field.
    Two sources that disagree on a field are a ConfigError naming both."""
    merged: dict[str, dict] = {}
    origin: dict[str, str] = {}
    for a in answers:
        for section, values in a["overrides"].items():
            for field, value in values.items():
                key = f"{section}.{field}"
                have = merged.setdefault(section, {})
                if field in have and have[field] != value:
                    raise ConfigError(f"{key}: {have[field]!r} from {origin[key]} but {value!r} from {a['source']}")
                have[field] = value
                origin[key] = a["source"]
    return merged, origin
