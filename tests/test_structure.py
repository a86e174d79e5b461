"""The package's structure rules, checked on its source: layers import one way, no cycles
(function-local imports count), no private names across modules, modules of a readable size,
and no kind-of-save branching outside the layout registry."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerofast"
MAX_LINES = 450
# Modules that are not library code: test data generators shipped for users' own tests.
NOT_LIBRARY = {"zerofast.testing.synthesize", "zerofast.testing.strategies"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import the module runs, at any depth."""
    tree = ast.parse(MODULES[module].read_text())
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names if alias.name.startswith("zerofast")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if not target.startswith("zerofast"):
                continue
            names = [a.name for a in node.names]
            # ``from . import x`` imports the submodule x when there is one.
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out += [(s, []) for s in subs] or [(target, names)]
            if subs and len(subs) < len(names):
                out.append((target, [n for n in names if f"{target}.{n}" not in MODULES]))
    return [(t, n) for t, n in out if t in MODULES or t == "zerofast._C"]


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _ in _imports(m):
            if target in MODULES and target != m:
                graph[m].add(target)
    return graph


def _package_of(module: str) -> str | None:
    """The package whose ``__init__`` importing ``module`` is not a cycle but its own export list."""
    return module.rsplit(".", 1)[0] if "." in module else None


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exporting its own submodules is how packages work; a submodule
    # importing a sibling through the package is the edge that would close a cycle.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def test_no_private_names_imported_across_modules():
    found = []
    for m in MODULES:
        for target, names in _imports(m):
            for name in names:
                # _C is the compiled extension, underscored by the convention torch extensions share.
                if name.startswith("_") and not name.startswith("__") and name != "_C":
                    found.append(f"{m} imports {name} from {target}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", [m for m in MODULES if m not in NOT_LIBRARY])
def test_library_modules_stay_readable(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by what it does"


def test_no_branching_on_the_kind_of_save_outside_the_layouts():
    pattern = re.compile(r"family ==|\.family\b|universal is not None")
    found = [f"{m}:{i}: {line.strip()}" for m, path in MODULES.items() if not m.startswith("zerofast.layouts")
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# Each layer, and the layers it may import. Lower layers never import higher ones.
LAYERS = [
    ("base", {"zerofast.base"}),
    ("discover", {"zerofast.discover"}),
    ("load", {"zerofast.load"}),
    ("plan", {"zerofast.plan"}),
    ("layouts", {"zerofast.layouts"}),
]


def _layer(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_the_input_layers_import_downward_only():
    found = []
    graph = _graph()
    for m in MODULES:
        mine = _layer(m)
        if mine is None:
            continue
        for target in graph[m]:
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                found.append(f"{m} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
            if theirs is None and mine <= 3 and not target.startswith(("zerofast.devices", "zerofast.native.ops",
                                                                         "zerofast.native.reference")):
                found.append(f"{m} ({LAYERS[mine][0]}) imports {target}, a layer above the plan")
    assert not found, "\n".join(found)


# The executor (step 4) sits on the plan: it moves bytes by plans and knows nothing of how a save
# is found, read or planned (prepare.py, above it and the layouts, composes steps 1-3).
EXECUTE_MAY_IMPORT = ("zerofast.base", "zerofast.load", "zerofast.plan", "zerofast.devices", "zerofast.native.ops",
                      "zerofast.native.reference", "zerofast.execute")


def test_the_executor_sits_on_the_plan():
    graph = _graph()
    found = [f"{m} imports {target}" for m in MODULES if m == "zerofast.execute" or m.startswith("zerofast.execute.")
             for target in graph[m] if not target.startswith(EXECUTE_MAY_IMPORT)]
    assert not found, "\n".join(found)


# What a device can do is its registry entry's (zerofast/devices/__init__.py): the executor picks
# its path from that entry, never by the name of a device type.
DEVICE_TYPES = re.compile(r"(cpu|cuda|xpu|mps|hip|meta)(:\d+)?")


def _device_type_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code (not a docstring) names a device type: a string that is one, or torch.cuda."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and DEVICE_TYPES.fullmatch(node.value):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node.value) == "torch":
            found.append((node.lineno, "torch.cuda"))
    return found


def test_the_executor_names_no_device_type():
    found = [f"{m}:{line}: {what}" for m, path in MODULES.items()
             if m == "zerofast.execute" or m.startswith("zerofast.execute.")
             for line, what in _device_type_names(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_device_type_check_sees_each_way_of_naming_one():
    code = ('"""A docstring naming "cpu" is fine."""\nx = "cpu"\nif d.type == "cuda:0": pass\ntorch.cuda.current_stream()\n'
            'y = "cpus"\n')
    assert [line for line, _ in _device_type_names(ast.parse(code))] == [2, 3, 4]


# The output side: results (in memory), output (what every writer of files shares), and the two
# kinds of file writers on top of it, neither importing the other.
OUTPUT_RULES = {
    "zerofast.results": ("zerofast.output", "zerofast.hf", "zerofast.writers"),
    "zerofast.output": ("zerofast.results", "zerofast.hf", "zerofast.writers"),
    "zerofast.hf": ("zerofast.writers",),
    "zerofast.writers": ("zerofast.hf",),
}


def test_the_output_side_imports_downward_only():
    graph = _graph()
    found = [f"{m} imports {target}" for m in MODULES for prefix, banned in OUTPUT_RULES.items()
             if m == prefix or m.startswith(prefix + ".")
             for target in graph[m] if target.startswith(banned)]
    assert not found, "\n".join(found)


def test_public_functions_and_their_modules_have_different_names():
    """``import zerofast.hf.distributed`` then ``zerofast.hf.distributed.shared_export`` works: no
    public function shares its name with a module of the package it is exported from, and no two
    export functions share one name (``zerofast.export`` is the one ``export``)."""
    import importlib

    import zerofast

    for name in ("export", "load_exported", "reshard", "to_universal"):
        assert callable(getattr(zerofast, name)), name
    for module in ("zerofast.hf.distributed", "zerofast.writers.reshard", "zerofast.writers.universal"):
        importlib.import_module(module)
    assert callable(zerofast.hf.distributed.shared_export)
    assert not hasattr(zerofast.hf.distributed, "export")  # an old call fails rather than export on every rank
    assert callable(zerofast.export)


# The plan has one form: a plan's tensors are a PlanTensors, a builder's entries an EntryTable.
# Entries or plans made one by one become that form where they are handed over, by the one
# door that may ask which it got (a plan adapted outside zerofast.plan is a dict of TensorPlans).
PLAN_FORMS = {"PlanTensors", "EntryTable", "dict", "Mapping", "TableSegments"}
PLAN_FORM_DOORS = {("zerofast.plan.columns", "columns_of")}
# A dict (or Mapping) asked of something named as plan material is a dict of entries or plans;
# asked of anything else (a pickle's records) it is not about the plan.
PLAN_MATERIAL = re.compile(r"tensors|entries|entry|plan|tps|cols|parts|layer|trainable|frozen|buffers|placed")
# The modules that hold plans and entries; elsewhere a dict is a record read from a file.
PLAN_MODULES = ("zerofast.plan", "zerofast.execute", "zerofast.output", "zerofast.prepare", "zerofast.results",
                "zerofast.load_into")


def _form_tests(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, function, code) of each ``type(x) is/is not T``, ``type(x) in (...)`` and
    ``isinstance(x, T)`` naming a form of the plan."""
    found = []

    def names(node) -> set[str]:
        return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            test = subject = None
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "isinstance" \
                    and len(child.args) == 2:
                test, subject = child.args[1], child.args[0]
            elif isinstance(child, ast.Compare) and isinstance(child.left, ast.Call) and \
                    isinstance(child.left.func, ast.Name) and child.left.func.id == "type" and child.left.args:
                test, subject = ast.Tuple(elts=child.comparators), child.left.args[0]
            forms = names(test) & PLAN_FORMS if test is not None else set()
            if forms - {"dict", "Mapping"} or (forms and PLAN_MATERIAL.search(ast.unparse(subject))):
                found.append((child.lineno, inner, ast.unparse(child)))
            visit(child, inner)

    visit(tree, "")
    return found


def test_no_module_branches_on_the_form_of_the_plan():
    found = []
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        found += [f"{m}:{line} ({function}): {code}" for line, function, code in _form_tests(tree)
                  if (m, function) not in PLAN_FORM_DOORS
                  and (m.startswith(PLAN_MODULES) or not re.search(r"\b(dict|Mapping)\b", code))]
    assert not found, "branches on the plan's form:\n" + "\n".join(found)


def test_the_form_check_sees_each_way_of_asking():
    code = ("def f(x, tensors):\n    if type(x) is PlanTensors: pass\n    if isinstance(x, (EntryTable, list)): pass\n"
            "    if type(tensors) is not dict: pass\n    if isinstance(x, int): pass\n    if isinstance(x, dict): pass\n")
    assert [line for line, _, _ in _form_tests(ast.parse(code))] == [2, 3, 4]


# The top level shows what is public: the package's own files, the one public module, and the
# packages (each a step of the pipeline or a part beside it, named in zerofast/__init__.py). A
# step that one file holds is that file rather than a package around it.
TOP_LEVEL_FILES = {"__init__.py", "__main__.py", "compat.py"}
STEP_MODULES = {"discover.py", "prepare.py", "results.py"}


def test_the_top_level_holds_only_the_public_entry_points_and_the_packages():
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert TOP_LEVEL_FILES <= files, f"{sorted(TOP_LEVEL_FILES - files)} missing"
    assert files <= TOP_LEVEL_FILES | STEP_MODULES, f"move {sorted(files - TOP_LEVEL_FILES - STEP_MODULES)} into a package"
    parts = sorted([p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
                   + [Path(name).stem for name in files & STEP_MODULES])
    doc = (PACKAGE / "__init__.py").read_text()
    assert all(f"``{name}``" in doc for name in parts), "zerofast/__init__.py names each package and step module"


def test_every_subcommand_lives_in_the_cli_package():
    found = [m for m, path in MODULES.items() if not m.startswith("zerofast.cli")
             and re.search(r"\.add_parser\(|add_subparsers\(", path.read_text())]
    assert not found, f"commands defined outside zerofast.cli: {found}"


CSRC_LOAD = PACKAGE.parent / "csrc" / "load"
_TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10|caffe2)/', re.MULTILINE)


def test_the_python_half_of_the_core_includes_no_torch_header():
    # csrc/load/ is compiled against CPython and pybind11 alone, so that its code loads beside any
    # torch (issue 45); the torch objects it needs come in through bind_torch.
    sources = sorted(CSRC_LOAD.glob("*.[ch]*"))
    assert len(sources) >= 10, f"expected csrc/load/'s sources, found {sources}"
    offending = [f"{p.name}: {m.group(0).strip()}" for p in sources for m in _TORCH_INCLUDE.finditer(p.read_text())]
    assert offending == []


def test_the_torch_include_check_sees_each_spelling():
    for line in ("#include <torch/extension.h>", '#include "ATen/Parallel.h"', "  #  include <c10/core/Storage.h>"):
        assert _TORCH_INCLUDE.search(line), line
    assert not _TORCH_INCLUDE.search("#include <pybind11/pybind11.h>")
