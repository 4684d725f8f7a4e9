"""The layering rules of the code base, checked by parsing every import with ``ast``.

The rules are data (RULES below): for each package, the prefixes its modules may not import,
with the exceptions that are part of the design. Every import counts, also those inside
functions and under TYPE_CHECKING, since they are dependencies all the same.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipetrain", "partitioners", "schedules")


@dataclass(frozen=True)
class Rule:
    """Modules under ``scope`` import nothing under ``forbidden`` except what is under ``allowed``
    or named exactly in ``exact`` (a package's own face, not its submodules)."""

    scope: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exact: tuple[str, ...] = ()
    why: str = ""

    def permits(self, target: str) -> bool:
        if target in self.exact or any(_under(target, a) for a in self.allowed):
            return True
        return not any(_under(target, f) for f in self.forbidden)


RULES = (
    Rule("schedules", ("torch", "pipetrain", "partitioners"),
         why="the schedule IR and the cluster model are pure Python: tests, simulator and planner read them"),
    Rule("partitioners", ("pipetrain",), why="planning never depends on the runtime"),
    Rule("pipetrain.allreduce", ("pipetrain",), allowed=("pipetrain.allreduce",),
         why="the gradient reducer is a standalone library"),
    Rule("pipetrain.optim", ("pipetrain",), allowed=("pipetrain.optim",),
         why="optimizers know nothing of pipelines"),
    Rule("pipetrain.tensor_parallel", ("pipetrain",), allowed=("pipetrain.tensor_parallel",),
         why="splitting a stage graph over tensor-parallel ranks knows nothing of pipelines: the assembly applies it"),
    Rule("pipetrain.runtime", ("pipetrain",), allowed=("pipetrain.runtime", "pipetrain.optim"),
         why="one device's runtime does not cross devices: pipetrain.comm builds on it, not the reverse"),
    Rule("pipetrain.comm", ("pipetrain",),
         allowed=("pipetrain.comm", "pipetrain.runtime", "pipetrain.allreduce", "pipetrain.options",
                  "pipetrain.optim", "pipetrain.tensor_parallel"),
         why="communication sits between the runtime and the face"),
    Rule("pipetrain.assembly", ("pipetrain.runner", "pipetrain.pipeline", "pipetrain.api", "pipetrain.checkpoint",
                                "pipetrain.cli", "pipetrain.apps"),
         why="assembly builds the parts in one forward pass; what runs them and the face sit above it"),
    Rule("pipetrain.apps", ("pipetrain",),
         allowed=("pipetrain.options", "pipetrain.optim", "pipetrain.apps"), exact=("pipetrain",),
         why="applications use only the public API, as a user's program would"),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name. ``from pkg import sub`` of a submodule
    counts as pkg.sub alone: the parent package runs first whatever one imports."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            ours = {sub for sub in subs if _is_our_module(sub, root)}
            found |= ours
            if len(ours) < len(subs):  # a name defined by the package itself: it depends on its face
                found.add(base)
    return found


def _is_our_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def source_files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    """Every import that breaks a rule, as 'module imports target (rule: why)'."""
    out = []
    for path in source_files(root):
        name = module_name(path, root)
        for rule in RULES:
            if not _under(name, rule.scope):
                continue
            for target in sorted(imports_of(path, root)):
                if not rule.permits(target):
                    out.append(f"{name} imports {target} (rule for {rule.scope}: {rule.why})")
    return out


def import_cycles(root: Path) -> list[list[str]]:
    graph = nx.DiGraph()
    for path in source_files(root):
        name = module_name(path, root)
        graph.add_node(name)
        for target in imports_of(path, root):
            if target != name and _is_our_module(target, root):
                graph.add_edge(name, target)
    return [sorted(c) for c in nx.simple_cycles(graph)]


# Attributes pipetrain.comm may write on objects it did not make: tensors' gradients, which gradient
# synchronisation exists to write. Everything else of the runtime it only reads; the runtime reports values.
COMM_WRITES = ("grad",)


def _root(target: ast.expr) -> ast.expr:
    """The object an assignment target writes into (``getattr(x, name)[i]`` writes into x)."""
    while True:
        if isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        elif isinstance(target, ast.Call) and ast.unparse(target.func) == "getattr":
            target = target.args[0]
        else:
            return target


def _names(target: ast.expr) -> list[ast.expr]:
    """The single targets of a possibly nested tuple unpacking."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _names(e)]
    return [target]


def _made_here(func: ast.FunctionDef) -> set[str]:
    """Names a function binds to objects it builds (a call, a literal, a comprehension) or to its own
    (``self``'s) state, and parameters annotated as the StepResult it fills in."""
    made = {a.arg for a in func.args.args if a.annotation is not None and "StepResult" in ast.unparse(a.annotation)}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            root = _root(node.value)
            if not isinstance(node.value, (ast.Name, ast.Attribute, ast.Subscript)) or (
                    isinstance(root, ast.Name) and root.id == "self"):
                made |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return made


def foreign_writes(root: Path, scope: str = "pipetrain.comm") -> list[str]:
    """Assignments in ``scope`` to attributes of objects it neither owns (``self``) nor made in that function."""
    out = []
    for path in source_files(root):
        name = module_name(path, root)
        if not _under(name, scope):
            continue
        for func in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            made = _made_here(func) | {"self"}
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for target in (n for t in targets for n in _names(t)):
                    base = _root(target)
                    if (isinstance(target, ast.Name) or (isinstance(base, ast.Name) and base.id in made)
                            or (isinstance(target, ast.Attribute) and target.attr in COMM_WRITES)):
                        continue
                    out.append(f"{name}:{node.lineno} writes {ast.unparse(target)}")
    return out


def test_comm_never_writes_the_state_of_objects_it_did_not_make() -> None:
    assert foreign_writes(ROOT) == []


def test_a_foreign_write_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, {"pipetrain/comm/bad.py": (
        "def report(rt, result: 'StepResult'):\n"
        "    rt.peak_activation_bytes = 0\n"
        "    rt.policy.errors[0] = 1.0\n"
        "    result.loss = 1.0\n"
        "    out = dict()\n"
        "    out['a'] = 1\n"
        "    rt.param.grad = None\n")})
    assert foreign_writes(tmp_path) == ["pipetrain.comm.bad:2 writes rt.peak_activation_bytes",
                                        "pipetrain.comm.bad:3 writes rt.policy.errors[0]"]


def test_the_code_base_keeps_every_layering_rule() -> None:
    assert violations(ROOT) == []


def test_no_import_cycles_between_modules() -> None:
    assert import_cycles(ROOT) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("rel, text, expected", [
    ("schedules/bad.py", "import torch\n", "schedules.bad imports torch"),
    ("schedules/bad.py", "from pipetrain.runtime import stage\n", "schedules.bad imports pipetrain.runtime"),
    ("partitioners/bad.py", "def f():\n    import pipetrain\n", "partitioners.bad imports pipetrain"),
    ("pipetrain/allreduce/bad.py", "from pipetrain.runtime.stage import X\n",
     "pipetrain.allreduce.bad imports pipetrain.runtime.stage"),
    ("pipetrain/runtime/bad.py", "from ..comm import transport\n", "pipetrain.runtime.bad imports pipetrain.comm"),
    ("pipetrain/apps/bad.py", "from pipetrain.runtime.stage import X\n",
     "pipetrain.apps.bad imports pipetrain.runtime.stage"),
])
def test_a_broken_rule_is_reported(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    _write(tmp_path, {"pipetrain/__init__.py": "", "pipetrain/runtime/__init__.py": "",
                      "pipetrain/runtime/stage.py": "", "pipetrain/comm/__init__.py": "",
                      "pipetrain/comm/transport.py": "", "pipetrain/options.py": "",
                      "pipetrain/apps/__init__.py": "from pipetrain import options\n", rel: text})
    found = violations(tmp_path)
    assert any(v.startswith(expected) for v in found), found
    assert not any(v.startswith("pipetrain.apps ") for v in found)  # the public face is allowed


def test_an_import_cycle_is_reported(tmp_path: Path) -> None:
    _write(tmp_path, {"schedules/__init__.py": "", "schedules/a.py": "from schedules import b\n",
                      "schedules/b.py": "from schedules.a import x\n"})
    assert import_cycles(tmp_path) == [["schedules.a", "schedules.b"]]
