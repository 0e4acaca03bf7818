"""The package's layout shows its architecture: subpackages that name the layers, imports that
point one way (no cycle between modules, function-level imports counted), modules of one idea
(at most 600 lines), few modules at the top, and a README that stays short."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "ddtree"

# The layers, lowest first: a module may import its own layer and those before it. The package's
# __init__ (the native extension, the ops' public names) sits below the commands that use it.
LAYERS = ["version", "_C", "ops", "parallel", "models", "budget", "generate", "train",
          "integrations", "__init__", "embedded", "demo", "cli"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
KNOWN = set(MODULES) | {"ddtree._C"}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str):
    """The ddtree modules `name` imports, anywhere in its source (functions included): for
    `from X import y`, X.y where that is a module, else X."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ddtree"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ddtree":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in KNOWN else target)
    return {m for m in out if m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_import_names_a_module_of_the_package():
    for name, targets in GRAPH.items():
        unknown = targets - KNOWN
        assert not unknown, f"{name} imports {sorted(unknown)}, which are not ddtree modules"


def find_cycle(graph):
    """A list of modules forming a cycle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_modules():
    assert find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(find_cycle(GRAPH))}"


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


def test_imports_point_down_the_layers():
    upward = [(name, t) for name, targets in GRAPH.items() for t in targets
              if layer(t) > layer(name)]
    assert not upward, "imports of a higher layer: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_the_layout_numbers():
    top_modules = [p.name for p in PACKAGE.glob("*.py")]
    subpackages = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    assert len(subpackages) >= 4, subpackages
    assert set(subpackages) <= set(LAYERS), f"a subpackage missing from LAYERS: {subpackages}"
    assert len(top_modules) <= 8, top_modules
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("package", sorted(p.name for p in PACKAGE.iterdir()
                                           if (p / "__init__.py").exists()))
def test_each_subpackage_says_what_lives_there(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and f"ddtree.{package}" in doc, f"ddtree.{package} has no docstring naming it"


def test_no_ordinal_run_names_in_bench_results():
    ordinal = re.compile(r"_(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                         r"\d+(st|nd|rd|th))_run")
    named = [p.name for p in (ROOT / "bench" / "results").iterdir() if ordinal.search(p.name)]
    assert not named, named
