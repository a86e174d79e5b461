"""The README and docs/ hold together: the README stays one readable page, every docs/ page is
reachable from it, every relative link (and its #anchor) leads somewhere, and every benchmark
result a page cites is in benchmarks/results."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
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
