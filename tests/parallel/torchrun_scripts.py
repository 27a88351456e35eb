"""Run a test worker script under torchrun (gloo, CPU) and read back each rank's JSON.

The two halves of one protocol: :func:`launch` (in the test) runs
``python -m torch.distributed.run --nproc-per-node N WORKER OUT_DIR '<scenarios json>'``;
:func:`worker_main` (the worker script's ``main``) runs ``run(scenario)`` for each scenario on
every rank and writes the list to ``OUT_DIR/rank{r}.json`` atomically. Used by
fsdp_offload_worker.py and fsdp_units_worker.py (sys.path[0] is this folder when torchrun runs them).
:func:`tp_warm_model` builds the TP workers' model (tp_collective_buffers_worker.py, op_boundary_worker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn


def launch(worker: str, scenarios: dict, nproc: int = 2, timeout: int = 300) -> dict:
    """``{key: [rank 0's result, rank 1's, ...]}`` for each ``key: scenario`` of ``scenarios``, all in
    one launch of ``worker`` (a file name in this folder); a failed launch fails the test with its stderr."""
    from trainmem.measure_dist.launch import free_port

    path = Path(__file__).with_name(worker)
    with tempfile.TemporaryDirectory(prefix=f"trainmem-{path.stem}-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
               str(path), tmp, json.dumps(list(scenarios.values()))]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {k: [ranks[r][i] for r in range(nproc)] for i, k in enumerate(scenarios)}


def worker_main(run: Callable[[dict], dict]) -> NoReturn:
    """A worker script's entry point under torchrun: ``argv = OUT_DIR '<scenarios json>'``."""
    import torch.distributed as dist

    out_dir, scenarios = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        results = [run(sc) for sc in scenarios]
        path = os.path.join(out_dir, f"rank{dist.get_rank()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)
    finally:
        dist.destroy_process_group()
    from trainmem.measure_dist.leave import leave

    leave(0)  # gloo's threads may still hold tensors: no interpreter finalization (measure_dist/leave.py)


def tp_warm_model(sc: dict):
    """The tiny Llama with ``sc["layers"]`` layers in ``sc["precision"]`` under the measure worker's
    torchtitan plan (``measure_dist.worker._apply_tp``, ``sc["sp"]``, vocab-parallel loss), its
    (``sc["batch"]``, ``sc["seq"]``) input ids and ``step()`` (forward and backward under
    ``loss_parallel()``, then ``zero_grad(set_to_none=True)``), after two warm-up steps and a barrier."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from trainmem.measure_dist.worker import DEFAULT_CONFIG, _apply_tp, _dtype
    from trainmem.models.hf import build_hf_model

    torch.manual_seed(0)
    cfg = dict(DEFAULT_CONFIG, num_hidden_layers=sc["layers"])
    model = build_hf_model(cfg, attention="sdpa", dtype=_dtype(sc["precision"]))
    _apply_tp(model, init_device_mesh("cpu", (dist.get_world_size(),)), sc["sp"], True)
    ids = torch.randint(0, cfg["vocab_size"], (sc["batch"], sc["seq"]), generator=torch.Generator().manual_seed(1000))

    def step():
        with loss_parallel():
            model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    dist.barrier()
    return model, ids, step
