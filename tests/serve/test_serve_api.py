"""``trainmem serve`` over plain HTTP: the numbers are the CLI's, bad requests are one-line 4xx
errors, and the server binds to loopback unless told otherwise."""

from __future__ import annotations

import json

import pytest

from serve_helpers import call, cli_json, post, running_server
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.allocation_order import estimate_reserved
from trainmem.plan.hardware import Reserve, load_gpu
from trainmem.serve import make_server
from trainmem.serve.server import MAX_BODY_BYTES
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model


@pytest.fixture(scope="module")
def base():
    with running_server() as url:
        yield url


# the page's numbers are the CLI's ---------------------------------------------------------------

CASES = {
    "gpt2 defaults": ({"model": "gpt2"}, ["estimate", "--model", "gpt2", "--json"]),
    "gpt2 B4 fp32 eager": ({"model": "gpt2", "batch": 4, "precision": "fp32", "attention": "eager"},
                           ["estimate", "--model", "gpt2", "--batch", "4", "--precision", "fp32",
                            "--attention", "eager", "--json"]),
    "8 GPUs, TP2 + SP, ZeRO-1": ({"model": "gpt2", "gpus": 8, "tp": 2, "sp": True, "zero": 1, "seq": 1024},
                                 ["estimate", "--model", "gpt2", "--seq", "1024", "--dp", "4", "--tp", "2",
                                  "--sp", "--zero", "1", "--json"]),
    "LoRA, full recompute": ({"model": "llama-2-7b", "finetune": "lora", "lora_rank": 16, "recompute": "full",
                              "seq": 2048, "gpu": "A100-40GB"},
                             ["estimate", "--model", "llama-2-7b", "--seq", "2048", "--recompute", "full",
                              "--finetune", "lora", "--lora-rank", "16", "--json"]),
}


@pytest.mark.parametrize("request_body, argv", CASES.values(), ids=list(CASES))
def test_estimate_equals_cli(base, capsys, request_body, argv):
    status, r = post(base, "/api/estimate", request_body)
    assert status == 200, r
    want = cli_json(capsys, argv)          # typed by hand
    shown = cli_json(capsys, r["command_estimate"] + " --json")  # the command the page shows
    want.pop("items"), shown.pop("items")
    assert r["estimate"] == want == shown
    _assert_verdict_is_clis(capsys, r["fits"], argv, request_body.get("gpu", "H100-80GB"))
    assert "<svg" in r["chart_svg"] and want["peak_phase"] in r["chart_svg"]


def _assert_verdict_is_clis(capsys, fits: dict, argv: list[str], gpu: str) -> dict:
    """serve's verdict is ``trainmem estimate --gpu G --memory-figure reserved``'s, and plan's/advise's."""
    v = cli_json(capsys, [*argv, "--gpu", gpu, "--memory-figure", "reserved"])["fits"]
    assert fits["memory_figure"] == v["figure"] == "reserved"
    assert (fits["peak_bytes"], fits["peak_reserved_bytes"]) == (v["allocated_bytes"], v["reserved_bytes"])
    assert (fits["usable_bytes"], fits["headroom_bytes"], fits["fits"], fits["fit_state"]) == \
        (v["usable_bytes"], v["headroom_bytes"], v["fits"], v["fit_state"])
    g = load_gpu(gpu)  # advise's budget (plan/hardware.py Reserve.modelled, the default --reserve-fraction 0)
    assert fits["usable_bytes"] == Reserve.modelled(g).reserved_usable_bytes(g, fits["gpus"])
    return v


def test_verdict_at_the_boundary_is_the_reserved_figure(base, capsys):
    """Mistral-7B S=4800 on H100 (tests/plan/test_plan_reserved_verdict.py): its allocated peak fits
    the old flat budget (capacity − 1 GiB − 5%), its modelled reserved peak does not: serve says no,
    as estimate's reserved figure, plan and advise do."""
    body = {"model": "mistral-7b", "seq": 4800, "attention": "mem-efficient", "gpu": "H100-80GB"}
    status, r = post(base, "/api/estimate", body)
    assert status == 200, r
    v = _assert_verdict_is_clis(capsys, r["fits"], ["estimate", "--model", "mistral-7b", "--seq", "4800",
                                                    "--attention", "mem-efficient", "--json"], "H100-80GB")
    h100 = load_gpu("H100-80GB")
    assert v["allocated_bytes"] <= Reserve(fixed_bytes=1 << 30, fraction=0.05).usable_bytes(h100)
    assert r["fits"]["fits"] is False and r["fits"]["reserve"] == {"fixed_bytes": h100.context_bytes, "fraction": 0.0}
    # over usable by its reserved peak, but it runs when the allocator flushes its cache (tests/test_fit_state.py)
    assert r["fits"]["fit_state"] == "fits_with_cache_flush"


def test_config_json_path(base, capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                   max_position_embeddings=2048)))
    status, r = post(base, "/api/estimate", {"model": str(tmp_path), "batch": 2})
    assert status == 200, r
    want = cli_json(capsys, ["estimate", "--model", str(tmp_path), "--batch", "2", "--json"])
    want.pop("items")
    assert r["estimate"] == want and want["inputs"]["model"]["num_kv_heads"] == 2


def test_fit_largest_batch_and_seq_are_the_boundary(base, capsys):
    body = {"model": "gpt2", "gpu": "rtx-4090", "precision": "fp32"}
    status, r = post(base, "/api/fit", body)
    assert status == 200, r
    gpu = load_gpu("rtx-4090")
    model, usable = load_model("gpt2"), Reserve.modelled(gpu).reserved_usable_bytes(gpu)
    assert r["usable_bytes"] == usable and r["memory_figure"] == "reserved"

    def peak(**kw) -> int:  # the reserved peak (allocator model), what plan, advise and sweep --gpu compare
        e = estimate(model, StepSpec(**{"batch": 1, "seq": 1024, "precision": "fp32", **kw}), ImplSpec())
        return estimate_reserved(e).reserved_bytes

    b = r["largest"]["batch"]["value"]
    assert b > 1 and peak(batch=b) <= usable < peak(batch=b + 1)
    s = r["largest"]["seq"]
    # gpt2 learned 1024 positions: at batch 1 the longest sequence fits, and the search stops there
    assert (s["value"], s["capped"]) == (1024, True) and peak(seq=1024) <= usable
    # the same search as ``trainmem sweep --gpu``
    sweep = cli_json(capsys, ["sweep", "--model", "gpt2", "--precision", "fp32", "--over", "batch",
                              "--gpu", "rtx-4090", "--json"])
    assert sweep["max_fit"] == b


@pytest.mark.slow  # 10-30 s on 2 shared cores: the default run is at its 10-minute budget
def test_fit_advice_equals_cli_advise(base, capsys):
    body = {"model": "llama-2-7b", "batch": 4, "seq": 4096, "attention": "eager", "gpu": "A100-80GB", "gpus": 8}
    status, r = post(base, "/api/fit", body)
    assert status == 200, r
    want = cli_json(capsys, ["advise", "--model", "llama-2-7b", "--batch", "4", "--seq", "4096", "--attention",
                             "eager", "--gpu", "A100-80GB", "--gpus", "8", "--json"])
    want["inputs"]["gpu"] = r["advice"]["inputs"]["gpu"]  # the page sends the preset's file name (a100-80gb)
    assert r["advice"] == want and want["steps"], "the case must need fixes"
    assert r["advice"] == cli_json(capsys, r["command_advise"] + " --json")


def test_options_come_from_the_cli(base):
    status, headers, raw = call(base, "GET", "/api/options")
    assert status == 200 and headers["content-type"] == "application/json"
    o = json.loads(raw)
    assert "gpt2" in o["presets"] and any(g["name"] == "h100-80gb" for g in o["gpus"])
    assert o["fields"]["precision"]["default"] == "bf16" and "fp32" in o["fields"]["precision"]["choices"]
    assert o["fields"]["sp"]["boolean"] and "dp" not in o["fields"]


def test_page_is_self_contained(base):
    status, headers, raw = call(base, "GET", "/")
    page = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]  # nothing but this server
    assert "http://" not in page and "https://" not in page and "<script src" not in page


# bad requests: one line, never a traceback ---------------------------------------------------

BAD = {
    "zero batch": ({"batch": 0}, 400, "argument --batch: --batch=0: must be positive"),
    "text batch": ({"batch": "four"}, 400, "argument --batch: --batch='four': must be an integer"),
    "unknown field": ({"bacth": 4}, 400, "unknown field 'bacth'"),
    "dp is derived": ({"dp": 2}, 400, "dp: not a field"),
    "unknown choice": ({"precision": "fp8"}, 400, "argument --precision: invalid choice: 'fp8'"),
    "boolean as number": ({"tp": 2, "gpus": 2, "sp": 1}, 400, "sp=1: must be true or false"),
    "list value": ({"model": ["gpt2"]}, 400, "model=['gpt2']: must be a string or a number"),
    "gpus vs degrees": ({"gpus": 6, "tp": 4}, 400, "SpecError: gpus=6: must be a multiple of tp × cp × pp = 4"),
    "unknown model": ({"model": "gtp2"}, 400, "ConfigError: unknown model 'gtp2'"),
    "unknown gpu": ({"gpu": "H1000"}, 400, "SpecError: gpu='H1000': unknown GPU"),
    "not an object": ([1, 2], 400, "request must be a JSON object, not list"),
    "flag-like value": ({"model": "--tp"}, 400, "ConfigError: unknown model '--tp'"),
}


@pytest.mark.parametrize("body, status, message", BAD.values(), ids=list(BAD))
@pytest.mark.parametrize("path", ["/api/estimate", "/api/fit"])
def test_bad_request_is_one_line(base, path, body, status, message):
    got, r = post(base, path, body)
    assert got == status and list(r) == ["error"]
    assert message in r["error"] and "\n" not in r["error"] and "Traceback" not in r["error"]


def test_spec_error_is_the_cli_line(base, capsys):
    from trainmem.cli import main

    body = {"model": "gpt2", "seq": 2048}  # gpt2 learned 1024 positions
    status, r = post(base, "/api/estimate", body)
    assert main(["estimate", "--model", "gpt2", "--seq", "2048"]) == 2
    assert status == 400 and r["error"] == capsys.readouterr().err.strip()


def _raw(base, body: bytes, headers: dict) -> tuple[int, dict]:
    status, _, raw = call(base, "POST", "/api/estimate", body, headers)
    r = json.loads(raw)
    assert list(r) == ["error"] and "\n" not in r["error"]
    return status, r


def test_body_limits(base):
    big = json.dumps({"model": "x" * MAX_BODY_BYTES}).encode()
    assert _raw(base, big, {"Content-Type": "application/json"})[0] == 413
    assert _raw(base, b"{not json", {"Content-Type": "application/json"})[0] == 400
    assert _raw(base, b"[" * 60000, {"Content-Type": "application/json"})[0] == 400  # too deep for json
    assert _raw(base, b"\xff\xfe", {"Content-Type": "application/json"})[0] == 400
    assert _raw(base, b'{"batch": 2}', {"Content-Type": "text/plain"})[0] == 415
    assert _raw(base, b"{}", {"Content-Type": "application/json", "Content-Length": "-5"})[0] == 400


def test_routes_and_host(base):
    for method, path, want in (("GET", "/nope", 404), ("GET", "/api/estimate", 405), ("POST", "/api/nope", 404)):
        status, _, raw = call(base, method, path, b"{}" if method == "POST" else None,
                              {"Content-Type": "application/json"})
        assert status == want and "error" in json.loads(raw)
    # a page elsewhere that rebinds its name to 127.0.0.1 is refused
    status, _, raw = call(base, "GET", "/api/options", headers={"Host": "evil.example:80"})
    assert status == 403 and "evil.example" in json.loads(raw)["error"]
    assert call(base, "GET", "/", headers={"Host": "localhost:1"})[0] == 200


def test_binds_loopback_by_default():
    server = make_server(port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    with pytest.raises(SpecError, match="host='0.0.0.0'.*--allow-remote"):
        make_server("0.0.0.0", 0)
    with pytest.raises(SpecError, match="host='example.com'"):
        make_server("example.com", 0)  # a name may resolve anywhere
    server = make_server("0.0.0.0", 0, allow_remote=True)
    try:
        assert server.server_address[0] == "0.0.0.0" and not server.check_host
    finally:
        server.server_close()


def test_port_in_use_is_one_line():
    first = make_server(port=0)
    try:
        with pytest.raises(SpecError, match=f"port={first.server_address[1]}"):
            make_server(port=first.server_address[1])
    finally:
        first.server_close()
