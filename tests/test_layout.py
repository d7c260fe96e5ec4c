"""The package layout: the packages stand in one order and no module imports a package above its
own (at module level, inside a function, or by name through `importlib` or `python -m`), no module
imports one that imports it back, no private name crosses a module, and every module imports on
its own."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bottom floor first: a module may import its own package and those before it
PACKAGES = ("torch_model", "pallas_kernels", "jax_bridge", "formats", "train", "parity")
# the only modules that may reach above their floor: the command table dispatches `parity` by name,
# and the benchmarks compare against transformers through parity's references
MAY_REACH_UP = ("train.cli", "train.bench")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(project module imported, names taken from it) for every import statement in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in modules else (base, [alias.name]))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _ in imports_of(name, path, modules):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def named_modules(path: Path, modules: dict[str, Path]) -> list[str]:
    """Project modules a file names in a string constant (`importlib.import_module(name)`, a
    command table, `python -m name`): imports by name, which the import statements do not show."""
    return [node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules]


def floor(module: str) -> int:
    return PACKAGES.index(module.split(".")[0])


def every_import(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The project modules a module imports, by statement or by name."""
    return [t for t, _ in imports_of(name, path, modules)] + named_modules(path, modules)


def may_reach_up(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in MAY_REACH_UP)


def upward_imports() -> list[str]:
    """'a -> b' for every import, by statement or by name, of a package above a's own."""
    modules = project_modules()
    found = []
    for name, path in modules.items():
        for target in sorted(set(every_import(name, path, modules))):
            if floor(target) > floor(name) and not may_reach_up(name):
                found.append(f"{name} -> {target}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_package_above_its_own():
    found = upward_imports()
    assert not found, "imports running up the package order " + " < ".join(PACKAGES) + ": " + "; ".join(found)


def test_nothing_below_parity_imports_parity_but_the_command_table_and_the_benchmarks():
    modules = project_modules()
    reaching = sorted({name for name, path in modules.items() if floor(name) < floor("parity")
                       for target in every_import(name, path, modules) if target.split(".")[0] == "parity"})
    assert all(may_reach_up(n) for n in reaching), reaching
    # the one by-name arrow the command table keeps, seen by the counter (it must not go blind)
    assert "train.cli" in reaching


def test_the_order_counter_sees_imports_inside_functions_and_by_name(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from parity import compare\n    return 'parity.run'\n")
    modules = {"parity.compare": module, "parity.run": module}
    assert [t for t, _ in imports_of("jax_bridge.m", module, modules)] == ["parity.compare"]
    assert named_modules(module, modules) == ["parity.run"]


def test_no_module_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "import cycles (every import counts, also inside functions): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_no_private_name_is_imported_from_another_module():
    modules = project_modules()
    crossing = [f"{name} takes {n} from {target}"
                for name, path in modules.items()
                for target, names in imports_of(name, path, modules)
                for n in names if n.startswith("_") and not n.startswith("__")]
    assert not crossing, crossing


def test_every_module_imports_in_a_fresh_interpreter_deepest_first():
    """With no cycle any order works; one interpreter importing the leaves of the tree first (the
    reverse of alphabetical order) catches a module that only imports after its parent did."""
    names = sorted(project_modules(), reverse=True)
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\nprint('ok', len(sys.argv) - 1)"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]


# transformers' decoder families (a sample of its model types): the product's code runs them through
# the model boundary (torch_model/causal_lm.py) and must decide nothing by family.
FAMILIES = ("llama", "qwen", "mixtral", "mistral", "gemma", "olmo", "deepseek", "phi", "granite", "glm", "falcon")


def family_names_in_code(path: Path) -> list[str]:
    """Identifiers and string literals (not docstrings or comments) of a module naming a family."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
            words.append(getattr(node, "name", None) or node.arg)
    return sorted({w for w in words if any(f in w.lower() for f in FAMILIES)})


def test_no_module_decides_anything_by_a_transformers_family(tmp_path):
    named = {name: found for name, path in project_modules().items() if (found := family_names_in_code(path))}
    assert not named, f"modules naming a transformers family in their code: {named}"
    planted = tmp_path / "planted.py"
    planted.write_text('"""Llama is fine in a docstring."""\n# and in a comment: Qwen3\n'
                       'def f(cfg):\n    return cfg.model_type == "qwen3_moe"\n')
    assert family_names_in_code(planted) == ["qwen3_moe"]
