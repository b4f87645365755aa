"""One vLLM wheel's sources read as types and signatures, by ast: the resolver behind experiments/vllm_surface.py.

`Resolver(wheel).chain(key)` follows a chain of tsrl's (vllm.LLM().llm_engine.step()[].outputs) through the wheel:
names through imports and vLLM's lazy MODULE_ATTRS maps, attributes through classes and their bases (methods,
properties, fields, enum members, attributes their methods assign on self), calls and subscripts through
annotations. Each step gives an entry: where it is defined, its kind, a callable's signature, or `missing`.
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

STEP = re.compile(r"\(\)|\[\]|\.[A-Za-z_]\w*")  # a chain's steps: a call, a subscript, an attribute
# What vLLM's sources do not annotate: a tsrl chain (no colon) or a vLLM definition (module:qualname) -> the classes
# it is, and why. Every alternative must hold what tsrl uses; a class a wheel lacks is skipped there.
DECLARED = {
    "worker": (("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker"),
               "the worker class vLLM mixes worker_extension_cls into (v1/worker/worker_base.py), GPU and CPU"),
    "vllm.v1.worker.gpu_worker:Worker.model_runner": (
        ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "vllm.v1.worker.gpu.model_runner:GPUModelRunner"),
        "V1, or V2 where VllmConfig.use_v2_model_runner chooses it (Worker._make_model_runner)"),
    "vllm.v1.worker.cpu_worker:CPUWorker.model_runner": (
        ("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "vllm.v1.worker.cpu.model_runner:CPUModelRunner"),
        "V1, or V2 where VllmConfig.use_v2_model_runner chooses it (CPUWorker.init_device)"),
    "worker.model_runner.get_model()": (("vllm.model_executor.models.qwen3:Qwen3ForCausalLM",),
                                        "get_model is annotated nn.Module; Qwen3 is the architecture tsrl trains"),
    "vllm.v1.engine.llm_engine:LLMEngine.renderer": (
        ("vllm.renderers.base:BaseRenderer",), "renderer_from_config is unannotated; every renderer is a BaseRenderer"),
}
# A reference: ("module", name), ("class", module, qualname), ("func", module, qualname, owner class or None),
# ("inst", module, qualname) an instance, ("list", element), ("dict", value), ("union", (refs...)).


def _flat(body):
    """Module-level statements, those in `if TYPE_CHECKING:` and try blocks included."""
    for s in body:
        if isinstance(s, (ast.If, ast.Try)):
            yield from _flat(s.body + s.orelse + [x for h in getattr(s, "handlers", []) for x in h.body])
        else:
            yield s


def _union(*refs):
    flat = []
    for r in refs:
        for x in (() if r is None else r[1] if r[0] == "union" else (r,)):
            if x not in flat and x != ("none",):
                flat.append(x)
    return None if not flat else flat[0] if len(flat) == 1 else ("union", tuple(flat))


def _name(node) -> str:
    return getattr(node, "id", getattr(node, "attr", ""))


class Resolver:
    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.files = {n for n in self.zip.namelist() if n.endswith(".py")}
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            base = name.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.files), None)
            self._trees[name] = ast.parse(self.zip.read(path)) if path else None
        return self._trees[name]

    def _absolute(self, module: str, level: int, target: str | None) -> str:
        parts = module.split(".")[: None if f"{module.replace('.', '/')}/__init__.py" in self.files else -1]
        return ".".join(parts[: len(parts) - max(level - 1, 0)] + ([target] if target else [])) if level else target

    # ---- names
    def lookup(self, module: str, name: str, depth: int = 0):
        """What `name` is in `module`: a class, function or submodule, through imports, aliases and vLLM's lazy
        MODULE_ATTRS maps ({"LLM": ".entrypoints.llm:LLM"}); None when it is not there."""
        tree = self.module(module)
        if tree is None or depth > 12:
            return None
        for s in _flat(tree.body):
            if isinstance(s, ast.ClassDef) and s.name == name:
                return ("class", module, name)
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name:
                return ("func", module, name, None)
            for a in s.names if isinstance(s, ast.ImportFrom) else ():
                if (a.asname or a.name) == name:
                    src = self._absolute(module, s.level, s.module)
                    sub = f"{src}.{a.name}"
                    return ("module", sub) if self.module(sub) else self.lookup(src, a.name, depth + 1)
        for s in _flat(tree.body):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
            if any(getattr(t, "id", None) == name for t in targets) and s.value is not None:
                return self.annotation(s.value, module)  # an alias: X = Y, X = A | list[B]
            if targets and isinstance(s.value, ast.Dict):
                for k, v in zip(s.value.keys, s.value.values, strict=False):
                    if getattr(k, "value", None) == name and ":" in str(getattr(v, "value", "")):
                        mod, attr = v.value.split(":")
                        src = self._absolute(module, len(mod) - len(mod.lstrip(".")), mod.lstrip(".") or None)
                        return self.lookup(src, attr, depth + 1)
        return ("module", f"{module}.{name}") if self.module(f"{module}.{name}") else None

    def classdef(self, ref) -> ast.ClassDef | None:
        tree = self.module(ref[1])
        return next((s for s in _flat(tree.body) if isinstance(s, ast.ClassDef) and s.name == ref[2]), None) \
            if tree else None

    def funcdef(self, ref):
        body = self.module(ref[1]).body if ref[3] is None else self.classdef(("class", ref[1], ref[3])).body
        return next(s for s in _flat(body) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and s.name == ref[2].split(".")[-1])

    def mro(self, ref, depth: int = 0) -> list:
        """The class and its bases in the wheel, depth first (the first definition of a name wins)."""
        node = self.classdef(ref)
        out = [("class", ref[1], ref[2])] if node and depth < 20 else []
        for b in node.bases if out else ():
            base = self.ref(b, ref[1])
            out += [r for r in (self.mro(base, depth + 1) if base and base[0] in ("class", "inst") else [])
                    if r not in out]
        return out

    # ---- annotations
    def ref(self, node, module: str):
        """A name or dotted attribute in `module` -> its reference, or None."""
        if isinstance(node, ast.Name):
            return self.lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            base = self.ref(node.value, module)
            return self.lookup(base[1], node.attr) if base and base[0] == "module" else None
        return self.ref(node.value, module) if isinstance(node, ast.Subscript) else None

    def annotation(self, node, module: str, owner=None):
        """A type annotation -> a reference: classes become instances; containers, Optional and unions are kept."""
        if isinstance(node, ast.Constant):
            return ("none",) if node.value is None else \
                self.annotation(ast.parse(node.value, mode="eval").body, module, owner) \
                if isinstance(node.value, str) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return _union(self.annotation(node.left, module, owner), self.annotation(node.right, module, owner))
        if isinstance(node, ast.Subscript):
            head, args = _name(node.value), node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if head in ("list", "List", "Sequence", "MutableSequence", "Iterable", "Iterator", "tuple", "set"):
                return ("list", self.annotation(args[0], module, owner))
            if head in ("dict", "Dict", "Mapping", "MutableMapping"):
                return ("dict", self.annotation(args[-1], module, owner))
            if head in ("Optional", "NotRequired", "Required", "Annotated", "ClassVar", "Final", "Union"):
                return _union(*(self.annotation(a, module, owner) for a in args))
        if isinstance(node, ast.Name) and node.id == "Self" and owner:
            return ("inst", owner[1], owner[2])
        r = self.ref(node, module) if node is not None else None
        return ("inst", r[1], r[2]) if r and r[0] == "class" else r if r and r[0] != "module" else None

    # ---- members
    def member(self, ref, name: str):
        """(kind, reference or None, module:qualname) of attribute `name` of a class or instance `ref`, through its
        bases: a method, property, field (class annotation), enum member, class attribute, or (instances) an
        attribute its methods assign on self. None when none of them has it."""
        for c in self.mro(ref):
            node, where = self.classdef(c), f"{c[1]}:{c[2]}.{name}"
            for s in node.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name:
                    if {_name(d) for d in s.decorator_list} & {"property", "cached_property"}:
                        return "property", self.annotation(s.returns, c[1], c), where
                    return "method", ("func", c[1], f"{c[2]}.{name}", c[2]), where
                if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", "") == name:
                    return "field", self.annotation(s.annotation, c[1], c), where
                if isinstance(s, ast.Assign) and any(getattr(t, "id", "") == name for t in s.targets):
                    enum = any("Enum" in _name(b) for b in node.bases)
                    return ("enum_member", ("inst", c[1], c[2]), where) if enum else ("class_attribute", None, where)
            if ref[0] == "inst" and (found := self._on_self(c, node, name)):
                return "attribute", found[0], where
        return None

    def _on_self(self, cls, node, name):
        """(type or None,) of `self.name = ...` in the class's methods: an annotation, a constructor, a call with an
        annotated return (Class.factory(...) too), or an annotated parameter."""
        found = None
        for f in (f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))):
            params = {a.arg: a.annotation for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]}
            for s in ast.walk(f):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
                if not any(_name(getattr(t, "value", None)) == "self" and getattr(t, "attr", "") == name
                           for t in targets):
                    continue
                if isinstance(s, ast.AnnAssign):
                    return (self.annotation(s.annotation, cls[1], cls),)
                v, t = s.value, None
                if isinstance(v, ast.Name) and params.get(v.id) is not None:
                    t = self.annotation(params[v.id], cls[1], cls)
                elif isinstance(v, ast.Call):
                    f_ref = self.ref(v.func, cls[1])
                    if f_ref is None and isinstance(v.func, ast.Attribute):  # Class.factory(...)
                        owner = self.ref(v.func.value, cls[1])
                        m = self.member(owner, v.func.attr) if owner and owner[0] == "class" else None
                        f_ref, owner_ref = (m[1], owner) if m and m[0] == "method" else (None, None)
                    t = ("inst", f_ref[1], f_ref[2]) if f_ref and f_ref[0] == "class" else \
                        self.annotation(self.funcdef(f_ref).returns, f_ref[1], cls if f_ref[3] is None else owner_ref) \
                        if f_ref and f_ref[0] == "func" else None
                if t is not None:
                    return (t,)
                found = found or (None,)
        return found

    # ---- callables
    def signature(self, ref) -> dict:
        """{positional (names, in order), positional_only, keyword_only, required, var_positional, var_keyword[,
        passes_on]} of a function, method or class (its __init__, else its dataclass / msgspec / TypedDict fields).
        passes_on: where a *args / **kwargs goes (the call in the body that passes it), with that callee's
        signature less the keywords the call names itself."""
        if ref[0] == "class":
            init = next((m for c in self.mro(ref) if (m := self.member(c, "__init__")) and m[0] == "method"), None)
            if init:
                return self.signature(init[1])
            fields = {}
            for c in reversed(self.mro(ref)):
                node = self.classdef(c)
                total = not any(k.arg == "total" and getattr(k.value, "value", 1) is False for k in node.keywords)
                for s in node.body:
                    ann = ast.unparse(s.annotation) if isinstance(s, ast.AnnAssign) else ""
                    if ann and not ann.startswith("ClassVar") and isinstance(s.target, ast.Name):
                        fields[s.target.id] = s.value is None and total and not ann.startswith("NotRequired")
            return {"positional": list(fields), "positional_only": [], "keyword_only": [],
                    "required": [k for k, r in fields.items() if r], "var_positional": False, "var_keyword": False}
        fn = self.funcdef(ref)
        a = fn.args
        pos = [p.arg for p in [*a.posonlyargs, *a.args]]
        required = pos[: len(pos) - len(a.defaults)] + [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults,
                                                                             strict=True) if d is None]
        drop = ref[3] is not None and "staticmethod" not in {_name(d) for d in fn.decorator_list}  # self / cls
        sig = {"positional": pos[drop:], "positional_only": [p.arg for p in a.posonlyargs][drop:],
               "keyword_only": [p.arg for p in a.kwonlyargs], "required": [p for p in required if p not in pos[:drop]],
               "var_positional": bool(a.vararg), "var_keyword": bool(a.kwarg)}
        for n in (n for n in ast.walk(fn) if isinstance(n, ast.Call)) if a.kwarg or a.vararg else ():
            star = a.vararg and any(isinstance(x, ast.Starred) and _name(x.value) == a.vararg.arg for x in n.args)
            dstar = a.kwarg and any(k.arg is None and _name(k.value) == a.kwarg.arg for k in n.keywords)
            target = self.ref(n.func, ref[1]) if star or dstar else None
            if target and target[0] in ("class", "func"):
                inner = self.signature(target)  # less what the call passes itself, positionally or by name
                named = set(inner["positional"][:sum(not isinstance(x, ast.Starred) for x in n.args)]) | \
                    {k.arg for k in n.keywords if k.arg}
                inner = {k: [p for p in v if p not in named] if isinstance(v, list) else v for k, v in inner.items()}
                sig["passes_on"] = {"to": f"{target[1]}:{target[2]}", "args": bool(star), "kwargs": bool(dstar),
                                    "signature": inner}
                break
        return sig

    # ---- chains
    def step(self, ref, step: str):
        """One step from `ref`: (next reference, entry for what was reached); the entry says `missing` when the
        wheel does not have it."""
        if ref is None:
            return None, {"missing": "the type before this step is not known (add it to DECLARED)"}
        if ref[0] == "union":  # the members that have it
            found = [(r, e) for r, e in (self.step(m, step) for m in ref[1]) if "missing" not in e]
            return (_union(*(r for r, _ in found)), found[0][1]) if found else self.step(ref[1][0], step)
        if step == "()":
            if ref[0] in ("class", "func"):
                reached = ("inst", ref[1], ref[2]) if ref[0] == "class" else self.annotation(
                    self.funcdef(ref).returns, ref[1], ("class", ref[1], ref[3]) if ref[3] else None)
                return reached, {"kind": "result"}
            return None, {"missing": f"not callable ({ref[0]})"}
        if step == "[]":
            if ref[0] in ("list", "dict"):
                return ref[1], {"kind": "element"}
            m = self.member(ref, "__getitem__") if ref[0] == "inst" else None
            if m and m[0] == "method":  # the first definition: an overload's, for an int index
                return self.annotation(self.funcdef(m[1]).returns, m[1][1], ref), {"kind": "element"}
            return None, {"missing": f"not subscriptable ({ref[0]})"}
        name = step[1:]
        if ref[0] == "module":
            found = self.lookup(ref[1], name)
            if not found:
                return found, {"missing": f"{ref[1]} has no {name}"}
            return found, self.describe(found, f"{ref[1]}:{name}")
        if ref[0] in ("class", "inst"):
            m = self.member(ref, name)
            if m is None:
                return None, {"missing": f"{ref[1]}:{ref[2]} has no attribute {name}"}
            return m[1], (self.describe(m[1], m[2], m[0]) if m[0] == "method" else {"kind": m[0], "where": m[2]})
        return None, {"missing": f"attribute {name} of a {ref[0]}"}

    def describe(self, ref, where: str, kind: str | None = None) -> dict:
        if ref and ref[0] in ("class", "func"):
            return {"kind": kind or ("class" if ref[0] == "class" else "function"), "where": f"{ref[1]}:{ref[2]}",
                    "signature": self.signature(ref)}
        return {"kind": kind or (ref[0] if ref else "unknown"), "where": where}

    def chain(self, key: str) -> list[dict]:
        """The entry of every alternative for `key` (one, unless DECLARED gives several classes on its way)."""
        if key.startswith("env:"):
            found = f'"{key[4:]}"' in self.zip.read("vllm/envs.py").decode()
            return [{"kind": "env", "where": "vllm.envs"} if found else {"missing": f"vllm/envs.py has no {key[4:]}"}]
        root = key.split(".")[0] if key.split(".")[0] in DECLARED else re.split(r"[(\[]", key, maxsplit=1)[0]
        if root in DECLARED:
            states = [(r, f"{root} as {c}", {"kind": "class", "where": c}) for c, r in self.declared(root)]
        else:  # walk the import path: module, then the names in it
            parts = root.split(".")
            i = max(i for i in range(1, len(parts) + 1) if self.module(".".join(parts[:i])))
            ref, entry = ("module", ".".join(parts[:i])), {"kind": "module", "where": ".".join(parts[:i])}
            for p in parts[i:]:
                ref, entry = self.step(ref, f".{p}")
            states = [(ref, root, entry)]
        prefix = root
        for s in STEP.findall(key[len(root):]):
            prefix, nxt = prefix + s, []
            for ref, via, entry in states:
                r, e = self.step(ref, s) if "missing" not in entry else (None, entry)
                decl = next((d for d in (prefix, e.get("where", "")) if d in DECLARED), None)
                nxt += [(d, f"{via} -> {c}", e) for c, d in self.declared(decl)] if decl and "missing" not in e \
                    else [(r, via, e)]
            states = nxt
        return [{**e, "via": v} if " as " in v or " -> " in v else e for _, v, e in states] or \
            [{"missing": f"no class DECLARED for {root} in this wheel"}]

    def declared(self, key: str) -> list[tuple[str, tuple]]:
        """(name, instance reference) of each class DECLARED for `key` that this wheel has."""
        return [(c, ("inst", *c.split(":"))) for c in DECLARED[key][0] if self.classdef(("class", *c.split(":")))]

