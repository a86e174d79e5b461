"""The README and docs/ hold together: the README stays one readable page, every docs/ page is
reachable from it, every relative link (and its #anchor) leads somewhere, every benchmark
result a page cites is in benchmarks/results, every module a page or a docstring names exists,
and docs/architecture.md's tree lists every module of the package."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "zerofast"
RESULTS = ROOT / "benchmarks" / "results"
MAX_README_LINES = 600

PAGES = [README, *sorted(DOCS.glob("*.md"))]
_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# A result file named in full (benchmarks/results/...) or by its bare name: 20261201-160900.json,
# verify-20261201-151040.json. A name cut short (-155458.json) does not name a file.
_RESULT_PATH = re.compile(r"benchmarks/results/[\w./-]*\w")
_RESULT_NAME = re.compile(r"(?<![\w/.-])((?:[a-z]+-)*\d{8}-\d{6}\.json)")
_RESULT_CUT = re.compile(r"(?<![\w-])-\d{6}\.json")


def _prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`+[^`]*`+", "``", line))
    return out


def _headings(path: Path) -> list[str]:
    """Heading texts, code spans kept (GitHub keeps their text in the anchor)."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.append(m.group(2))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(path):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path) for m in _LINK.finditer(line)]


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def test_slug_matches_github():
    assert _slug('On the GPU: `device="cuda"`') == "on-the-gpu-devicecuda"
    assert _slug("PyTorch Distributed Checkpoint (FSDP2, torchtitan): both ways") == \
        "pytorch-distributed-checkpoint-fsdp2-torchtitan-both-ways"
    assert _slug("When the native core cannot be built") == "when-the-native-core-cannot-be-built"


def test_readme_is_one_readable_page():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set()
    for target in links(README):
        file = target.split("#", 1)[0]
        if file and _relative(file):
            linked.add((README.parent / file).resolve())
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ holds no page"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if not _relative(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_cited_benchmark_results_exist(page):
    text = page.read_text()
    missing = [p for p in _RESULT_PATH.findall(text) if not (ROOT / p).exists()]
    missing += [n for n in _RESULT_NAME.findall(text) if not (RESULTS / n).exists()]
    cut = _RESULT_CUT.findall(text)
    assert not missing, f"{page.relative_to(ROOT)} cites results that are not in benchmarks/results: {missing}"
    assert not cut, f"{page.relative_to(ROOT)} cites results by a cut name (give the file's full name): {cut}"


# ---------------------------------------------------------------------------------------------
# Modules named in the docs and docstrings, and the architecture page's tree

# A module path as a page or docstring writes it, from the repository's root: zerofast/x/y.py,
# csrc/dir/ or csrc/dir/file.cpp (zerofast/csrc, the wheel's copy of csrc/, is no such path).
_MODULE_PATH = re.compile(r"(?<![\w/.-])(zerofast/[\w/]+\.py|csrc/[\w./-]*[\w/])")
# A module a docstring names as Sphinx does: :mod:`zerofast.x.y`, :mod:`.y`, :mod:`~..x`.
_MOD_ROLE = re.compile(r":mod:`~?([\w.]+)`")


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node, clean=False))]


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    """A module of the package: a file, or a folder of them (a namespace package such as writers)."""
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _absolute(name: str, path: Path) -> str:
    """:mod:'s name as Python resolves it in the module at ``path`` (``.x`` is a sibling of it)."""
    if not name.startswith("."):
        return name
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    dots = len(name) - len(name.lstrip("."))
    return ".".join(package[:len(package) - dots + 1] + [name.lstrip(".")]).rstrip(".")


@pytest.mark.parametrize("page", PAGES, ids=_IDS)
def test_module_paths_a_page_names_exist(page):
    missing = sorted({p for p in _MODULE_PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_modules_the_docstrings_name_exist():
    missing = []
    for path in SOURCES:
        for doc in _docstrings(path):
            missing += [f"{path.relative_to(ROOT)}: {p}" for p in _MODULE_PATH.findall(doc) if not (ROOT / p).exists()]
            missing += [f"{path.relative_to(ROOT)}: :mod:`{m}`" for m in _MOD_ROLE.findall(doc)
                        if _absolute(m, path).startswith("zerofast") and not _exists(_absolute(m, path))]
    assert not missing, "docstrings name modules that do not exist:\n" + "\n".join(missing)


ARCHITECTURE = DOCS / "architecture.md"
_TREE_NAME = re.compile(r"[\w.]+(/|\.\w+)")  # load/, archive.py, zerofast.cpp


def tree(text: str) -> dict[str, str]:
    """The tree in a page's first fenced block, as {path from the repository's root: the text of
    its entry}. A root sits at column 0 and an entry two columns further in per level (``load/``
    under ``zerofast/``, ``archive.py`` under ``load/``); an entry names one path or several
    (``moe.py, pipeline.py``), a folder's ending in ``/``; a line indented deeper than an entry
    could be continues the entry above it."""
    block = text.split("```", 2)[1]
    entries: dict[str, str] = {}
    folders: list[str] = []  # the folder of each level above the line
    current: list[str] = []
    for line in block.splitlines()[1:]:
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        names = _leading_names(body)
        if names and indent % 2 == 0 and indent // 2 <= len(folders):
            del folders[indent // 2:]
            current = ["".join(folders) + name for name in names]
            entries.update(dict.fromkeys(current, ""))
            folders += [name for name in names if name.endswith("/")][:1]
        for path in current:
            entries[path] += " " + body
    return entries


def _leading_names(text: str) -> list[str]:
    """The names an entry opens with: ``dcp.py, dcp_stand_ins.py  PyTorch DCP ...`` gives both."""
    names = []
    for part in text.split(", "):
        name = part.split(" ", 1)[0]
        if not _TREE_NAME.fullmatch(name):
            break
        names.append(name)
        if " " in part:
            break
    return names


def _listed(module: str, entries: dict[str, str]) -> bool:
    """Whether the tree lists ``module`` (a path): as an entry; by its folder's entry (a package's
    ``__init__.py``); or by name in the text of its folder's entry or of a file entry beside it
    (``base/  settings.py, dtypes.py ...``, ``__init__.py  the public API ...; compat.py ...``)."""
    folder, _, name = module.rpartition("/")
    folder += "/"
    if module in entries or (name == "__init__.py" and folder in entries):
        return True
    texts = [entries.get(folder, "")]
    texts += [t for p, t in entries.items() if p.rpartition("/")[0] + "/" == folder and not p.endswith("/")]
    return any(re.search(rf"(?<![\w./]){re.escape(name)}\b", t) for t in texts)


def test_the_architecture_tree_parses_entries_and_their_continuations():
    text = ("```\npkg/\n  a.py     one\n           more of a\n  sub/     b.py and c.py\n    d.py, e.py  two\n"
            "  f.py     g.py beside\ntop/     its line\n```\n")
    entries = tree(text)
    assert sorted(entries) == ["pkg/", "pkg/a.py", "pkg/f.py", "pkg/sub/", "pkg/sub/d.py", "pkg/sub/e.py", "top/"]
    assert "more of a" in entries["pkg/a.py"] and "more of a" not in entries["pkg/sub/"]
    assert all(_listed(m, entries) for m in ("pkg/a.py", "pkg/sub/b.py", "pkg/sub/__init__.py", "pkg/g.py"))
    assert not any(_listed(m, entries) for m in ("pkg/b.py", "pkg/h.py", "pkg/sub/g.py", "other/__init__.py"))


def test_the_architecture_tree_lists_every_module_and_nothing_else():
    entries = tree(ARCHITECTURE.read_text())
    modules = [str(p.relative_to(ROOT)) for p in SOURCES]
    unlisted = [m for m in modules if not _listed(m, entries)]
    gone = [p for p in entries if not (ROOT / p).exists()]
    assert not unlisted, f"docs/architecture.md's tree leaves out {unlisted}"
    assert not gone, f"docs/architecture.md's tree lists what does not exist: {gone}"
