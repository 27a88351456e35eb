"""The public facade (``trainmem/__init__.py``) and the one error hierarchy (``trainmem/errors.py``)."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import trainmem
import trainmem.errors as errors

SRC = Path(trainmem.__file__).parent


def test_all_is_frozen():
    assert trainmem.__all__ == [
        "estimate", "trace", "load_model",
        "ModelSpec", "StepSpec", "ImplSpec", "ParallelSpec", "FinetuneSpec",
        "TrainmemError", "SpecError", "ConfigError", "UnsupportedError", "OutOfMemory", "DistributedRunError",
        "PlotDependencyError", "DoesNotFit", "RequestError", "HTTPStatusError",
        "guard", "largest_micro_batch"]


@pytest.mark.parametrize("name,home", [
    ("load_model", "trainmem.specs.loaders"), ("ModelSpec", "trainmem.specs"), ("StepSpec", "trainmem.specs"),
    ("ImplSpec", "trainmem.specs"), ("ParallelSpec", "trainmem.specs"), ("FinetuneSpec", "trainmem.specs.finetune"),
    ("guard", "trainmem.integrations"), ("largest_micro_batch", "trainmem.integrations"),
    *((e, "trainmem.errors") for e in errors.__all__),
])
def test_every_export_is_its_home_modules_object(name, home):
    assert getattr(trainmem, name) is getattr(importlib.import_module(home), name)
    assert name in trainmem.__all__ and name in dir(trainmem)


def test_import_trainmem_imports_no_heavy_dependency():
    code = ("import sys, trainmem; trainmem.estimate; trainmem.trace; trainmem.load_model; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]"]


def test_estimate_is_the_subpackage_and_its_function():
    import trainmem.estimate as est  # the subpackage, as before

    assert est is trainmem.estimate and est.__all__ == ["estimate", "Estimate"]
    model, step = trainmem.load_model("gpt2"), trainmem.StepSpec(batch=1, seq=128)
    assert trainmem.estimate(model, step) == est.estimate(model, step)


def test_estimate_stays_callable_after_its_submodules_load():
    code = ("import trainmem.estimate.peak, trainmem.trace.allocator, trainmem; "
            "print(callable(trainmem.estimate), callable(trainmem.trace))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_trace_is_the_subpackage_and_its_context_manager():
    torch = pytest.importorskip("torch")
    import trainmem.trace as t

    assert t is trainmem.trace and "trace_step" in t.__all__
    lin = torch.nn.Linear(8, 8, bias=False)
    with trainmem.trace(lin) as tr:
        lin(torch.ones(2, 8)).sum().backward()
    # the weight (8·8·4 = 256 B) and its gradient, each one 512 B block
    assert tr.result.totals_at_peak_bytes["parameter"] == 512
    assert tr.result.totals_at_peak_bytes["gradient"] == 512


def _exception_classes() -> list[tuple[str, str]]:
    """(module file, class) for every class in src/trainmem whose bases name an Error or Exception."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                if any(b.endswith(("Error", "Exception")) or b in errors.__all__ for b in bases):
                    found.append((str(path.relative_to(SRC)), node.name))
    return found


def test_every_exception_lives_in_errors_py():
    outside = [(f, c) for f, c in _exception_classes() if f != "errors.py"]
    assert outside == []


def test_errors_form_one_hierarchy():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.TrainmemError), name


def test_old_import_paths_still_work():
    from trainmem.integrations import DoesNotFit
    from trainmem.measure import OutOfMemory
    from trainmem.measure_dist import DistributedRunError
    from trainmem.report.plots import PlotDependencyError
    from trainmem.serve.request import RequestError

    assert (OutOfMemory, DistributedRunError, PlotDependencyError, DoesNotFit, RequestError) == (
        errors.OutOfMemory, errors.DistributedRunError, errors.PlotDependencyError, errors.DoesNotFit,
        errors.RequestError)
