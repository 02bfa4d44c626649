"""The three packages and the one-way arrows between them: operator -> trainingrun_api <- trainer.

Read from the source (every import statement, at module level or inside a function, type-only ones included), so an
arrow the wrong way fails here before any image is built.
"""

import ast
import functools
import sys
from pathlib import Path
from typing import Optional

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "trainingrun_api": REPO / "common",
    "trainingrun_operator": REPO / "operator",
    "trainingrun_trainer": REPO / "trainer_image",
}
#: What the shared package may import besides the standard library: the config models, their YAML and JSON (the
#: project's base dependencies, in both images).
API_THIRD_PARTY = {"pydantic", "yaml", "orjson"}


@functools.cache
def syntax_tree(path: Path) -> ast.Module:
    """A source file parsed once for all the checks here."""
    return ast.parse(path.read_text(), str(path))


def imported_packages(package: str) -> dict[str, set[str]]:
    """{top-level package imported: the package's modules that import it}, relative imports resolved."""
    found: dict[str, set[str]] = {}
    root = PACKAGES[package]
    for path in (root / package).rglob("*.py"):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(syntax_tree(path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else [package]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(module)
    return found


def test_the_shared_package_imports_neither_side_nor_torch():
    imports = imported_packages("trainingrun_api")
    outside = {
        name: sorted(modules)
        for name, modules in imports.items()
        if name not in sys.stdlib_module_names and name not in API_THIRD_PARTY | {"trainingrun_api"}
    }
    assert not outside, f"trainingrun_api must stay torch-free and import neither side: {outside}"


@pytest.mark.parametrize(
    "package, other", [("trainingrun_operator", "trainingrun_trainer"), ("trainingrun_trainer", "trainingrun_operator")]
)
def test_neither_side_imports_the_other(package, other):
    # The CLI's trainer-side commands (`checkpoints`, `prepare`...) load the trainer when they run, by name
    # (cli_local.trainer_module), so an operator image without torch still starts: not an import statement.
    assert other not in imported_packages(package), sorted(imported_packages(package)[other])


def private_torch_names(path: Path) -> list[str]:
    """The private torch names a module uses: imported from a private module or by a private name, or reached as a
    private attribute of a name it bound to torch or a torch module."""
    found, torch_names = [], set()
    tree = syntax_tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or alias.name.split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if private_module or alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_only_torch_internals_uses_private_torch_names():
    package = PACKAGES["trainingrun_trainer"] / "trainingrun_trainer"
    users = {
        str(path.relative_to(package)): names
        for path in package.rglob("*.py")
        if path.name != "torch_internals.py" and (names := private_torch_names(path))
    }
    assert not users, f"private torch names belong in torch_internals.py, with the reason: {users}"
    assert private_torch_names(package / "torch_internals.py")  # the scan sees them where they are


def module_imports() -> dict[str, set[str]]:
    """{module: the modules of the three packages it imports}, every import statement counted (type-only and inside
    functions too), a package's own modules resolved from relative imports."""
    paths = {}
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        graph[module] = set()
        for node in ast.walk(syntax_tree(path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package_parts[: len(package_parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
    return circles


def test_no_module_imports_in_a_circle():
    assert import_circles(module_imports()) == []
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds one


def test_both_sides_import_the_shared_package():
    assert "trainingrun_api" in imported_packages("trainingrun_operator")
    assert "trainingrun_api" in imported_packages("trainingrun_trainer")


#: A soft ceiling: a module holds one concept, and past this it likely holds more. It was a hard 400, which split
#: single concepts into mixins across files; CheckpointStore's parts now compose (`checkpoint/store.py`).
MAX_SOURCE_LINES = 600

#: No module is exempt from mypy's check of what it reads of `self`: a part that needs one is a mixin, which exists
#: only to split a class across files (the parts of CheckpointStore, Run and Trainer compose instead).
MIXIN_MODULES_LEFT: set[str] = set()


def test_no_new_module_is_exempt_from_checking_what_it_reads_of_self():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    exempt = {
        module
        for override in config["tool"]["mypy"].get("overrides", [])
        if "attr-defined" in override.get("disable_error_code", [])
        for module in override["module"]
    }
    assert exempt <= MIXIN_MODULES_LEFT, f"compose these instead of exempting them: {exempt - MIXIN_MODULES_LEFT}"


def test_no_source_file_is_longer_than_a_reader_can_hold():
    long = {
        str(path.relative_to(REPO)): lines
        for package in PACKAGES.values()
        for path in sorted(package.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_SOURCE_LINES
    }
    assert long == {}, f"split these along the seams their docstrings name: {long}"


#: What a run is, which the operator's runtime (informer, API client, leadership, rechecks) must not depend on.
DOMAIN = {"api", "api_env", "api_meta", "api_status", "builders", "reconcile", "validation"}


def operator_modules_imported(path: Path) -> set[str]:
    """The trainingrun_operator modules (below the package, dotted) a module of the operator imports, relative
    imports resolved, `from .. import api` included."""
    package = PACKAGES["trainingrun_operator"]
    here = path.relative_to(package).with_suffix("").parts  # ("trainingrun_operator", "runtime", "kube")
    found = set()
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level])
            elif (node.module or "").startswith("trainingrun_operator"):
                base = []
            else:
                continue
            module = base + ((node.module or "").split(".") if node.module else [])
            for alias in node.names:
                found.add(".".join(module[1:] + [alias.name]))  # a name may be a module or a symbol: both kept
                found.add(".".join(module[1:]))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("trainingrun_operator.")
                for a in node.names
                if a.name.startswith("trainingrun_operator.")
            }
    return found


def operator_module_path(name: str) -> Optional[Path]:
    """The file of operator module `name` (dotted below the package), or None when `name` is a symbol."""
    base = PACKAGES["trainingrun_operator"] / "trainingrun_operator" / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if name and path.is_file():
            return path
    return None


def operator_modules_reached(path: Path) -> set[str]:
    """Every operator module `path` imports, and every one those import, and so on."""
    reached: set[str] = set()
    todo = [path]
    while todo:
        for name in operator_modules_imported(todo.pop()):
            found = operator_module_path(name)
            if found is not None and name not in reached:
                reached.add(name)
                todo.append(found)
    return reached


def test_the_operators_runtime_does_not_import_what_a_run_is():
    """Nor through another module: the runtime takes what it needs of the operator (a queue, the clock, settings) as
    arguments, and never the operator's state."""
    runtime = PACKAGES["trainingrun_operator"] / "trainingrun_operator" / "runtime"
    modules = sorted(runtime.glob("*.py"))
    assert {p.stem for p in modules} >= {"kube", "informer", "leadership", "rechecks"}
    wrong = {
        path.stem: sorted(name for name in operator_modules_reached(path) if name.split(".")[0] in DOMAIN | {"state"})
        for path in modules
    }
    assert {stem: names for stem, names in wrong.items() if names} == {}
    # The rule sees what it is for: handlers (not runtime) reaches reconcile, and through state too.
    assert "reconcile" in operator_modules_reached(runtime.parent / "handlers.py")
    assert "builders" in operator_modules_reached(runtime.parent / "state.py")


def private_reaches() -> set[tuple[str, str]]:
    """(importing module, name) for every `from <one of ours> import _name` (dunders aside)."""
    found = set()
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(syntax_tree(path)):
                ours = isinstance(node, ast.ImportFrom) and (
                    node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
                )
                if ours:
                    found |= {
                        (module, alias.name)
                        for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")
                    }
    return found


def test_no_new_module_reaches_into_another_ones_private_names():
    """A `_name` is its module's inside (issue 81 item 2): code another module needs is public, with a docstring."""
    assert private_reaches() == set(), "a private name used from another module: make it public, or move the code"
