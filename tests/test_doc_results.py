"""What the docs say of the results files, each check with a twin that runs it on a doctored copy of
the text (or of a results file) and must fail:

- one home per figure: a `median [lowest, highest]` figure of a results file stands in at most one
  of docs/*.md (the others link to it), and README.md quotes at most three of them;
- every results file a doc cites names the commit it measured, its machine and its date in its
  header, or every paragraph that cites it says "commit not recorded" (the files written before the
  benchmark tool wrote a `Commit:` line);
- no doc says a figure is of "the current code": nothing checks that pipeline/ and rewrite/ are
  unchanged since a run, so a figure names its commit instead;
- README.md stays under 900 words, and the licence is the same in LICENSE, pyproject.toml and README.md.
"""

from __future__ import annotations

import re
import shutil
from collections import defaultdict
from pathlib import Path

from tests.test_figures import _CODE, _SPREAD, citing_blocks, figures_in

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def guides() -> dict[str, str]:
    """docs/*.md by name: the docs among which each figure has one home."""
    return {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}


def readers() -> list[Path]:
    """Every doc a reader meets: the READMEs and docs/*.md."""
    named = [README, ROOT / "examples/dlrm/README.md", ROOT / "scripts/gpu/README.md"]
    return named + sorted(DOCS.glob("*.md"))


# --- one home per figure --------------------------------------------------------------------------


def quoted_figures(text: str, docs_dir: Path) -> list[tuple[int, str, str]]:
    """(line, results file, figure) of each `median [lowest, highest]` figure that `text` quotes in a
    paragraph citing a results file that holds it (`results/x.md` or `gpu-results/x.md`)."""
    held: dict[str, set[tuple[str, str, str]]] = {}
    found = []
    for line, block, cited in citing_blocks(text):
        for m in _SPREAD.finditer(_CODE.sub(" ", block)):
            figure = tuple(g.replace(",", "").lstrip("+") for g in m.groups())
            for name in cited:
                if name not in held:
                    path = docs_dir / name
                    held[name] = figures_in(path.read_text())[0] if path.is_file() else set()
                if figure in held[name]:
                    found.append((line, name, f"{figure[0]} [{figure[1]}, {figure[2]}]"))
    return found


def repeated_figures(docs: dict[str, str], docs_dir: Path) -> list[str]:
    """Each figure of a results file quoted in more than one of `docs`: `<figure> of <file>: <docs>`."""
    homes: dict[tuple[str, str], set[str]] = defaultdict(set)
    for doc, text in docs.items():
        for _, name, figure in quoted_figures(text, docs_dir):
            homes[(name, figure)].add(doc)
    return [
        f"{figure} of {name}: in {', '.join(sorted(where))}"
        for (name, figure), where in sorted(homes.items())
        if len(where) > 1
    ]


def readme_figures(readme: str, docs_dir: Path) -> set[tuple[str, str]]:
    """The distinct (results file, figure) pairs README.md quotes."""
    return {(name, figure) for _, name, figure in quoted_figures(readme, docs_dir)}


def test_each_figure_has_one_home():
    repeated = repeated_figures(guides(), DOCS)
    assert not repeated, "a figure quoted in two docs (keep it in one, link from the other):\n" + "\n".join(
        repeated
    )
    quoted = readme_figures(README.read_text(), DOCS)
    assert 0 < len(quoted) <= 3, f"README.md quotes {len(quoted)} figures of results files: {sorted(quoted)}"


def test_a_figure_copied_into_a_second_doc_fails_the_check():
    docs = guides()
    _, name, figure = quoted_figures(docs["benchmarks.md"], DOCS)[0]
    copied = dict(docs)
    copied["pipeline.md"] += f"\n\n## Copied\n\nIt took {figure} of torchrec's step ([the run]({name})).\n"
    assert repeated_figures(docs, DOCS) == []
    assert repeated_figures(copied, DOCS) == [f"{figure} of {name}: in benchmarks.md, pipeline.md"]
    four = "".join(
        f"\n\nRun {k}: {f} ([the file]({n})).\n"
        for k, (_, n, f) in enumerate(quoted_figures(docs["benchmarks.md"], DOCS))
    )
    assert len(readme_figures(four, DOCS)) > 3


# --- results that name what they measured --------------------------------------------------------

UNRECORDED = re.compile(r"commit\s+not\s+recorded", re.I)
"""What a paragraph citing a results file without a commit in its header says."""
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def header(text: str) -> str:
    """A results file's header: its lines before the first table row."""
    return re.split(r"^\|", text, maxsplit=1, flags=re.M)[0]


def unstated(text: str) -> list[str]:
    """What a results file's header does not name, of its commit, machine and date."""
    head = header(text)
    checks = {
        "commit": re.search(r"^Commit: [0-9a-f]{7,40}\b", head, re.M),
        "machine": re.search(r"^Machine: \S", head, re.M),
        "date": _DATE.search(head),
    }
    return [what for what, found in checks.items() if not found]


def unstamped_quotes(text: str, docs_dir: Path) -> list[str]:
    """Each paragraph (and the ones after it that it governs) citing a results file whose header
    lacks its commit, machine or date, and that does not say "commit not recorded":
    `<line>: <file> (no <what>)`."""
    found = []
    for line, block, cited in citing_blocks(text):
        if UNRECORDED.search(block):
            continue
        for name in cited:
            path = docs_dir / name
            missing = unstated(path.read_text()) if path.is_file() else []
            if missing:
                found.append(f"{line}: {name} (no {', '.join(missing)})")
    return found


def test_every_cited_results_file_names_its_commit_machine_and_date_or_the_doc_says_so():
    bad = [f"{d.relative_to(ROOT)}:{q}" for d in readers() for q in unstamped_quotes(d.read_text(), DOCS)]
    assert not bad, 'say "commit not recorded" where these paragraphs cite a file without one:\n' + "\n".join(
        bad
    )


def test_an_unstamped_file_quoted_without_saying_so_fails_the_check(tmp_path):
    docs_dir = tmp_path / "docs"
    shutil.copytree(DOCS / "results", docs_dir / "results")
    stamped = docs_dir / "results" / "verdict-1gbit.md"
    assert unstated(stamped.read_text()) == []
    doc = "## Speed\n\nOur SparseDist took 0.42 [0.42, 0.42] ([the run](results/verdict-1gbit.md)).\n"
    assert unstamped_quotes(doc, docs_dir) == []
    stamped.write_text(
        "\n".join(ln for ln in stamped.read_text().splitlines() if not ln.startswith("Commit:"))
    )
    assert unstated(stamped.read_text()) == ["commit", "date"]
    assert [q.split(": ", 1)[1] for q in unstamped_quotes(doc, docs_dir)] == [
        "results/verdict-1gbit.md (no commit, date)"
    ]
    assert unstamped_quotes(doc.replace("took", "took (commit not recorded)"), docs_dir) == []


# --- "the current code" ---------------------------------------------------------------------------

CURRENT = re.compile(
    r"\b(?:the\s+)?current\s+(?:code|version|figures?|runs?|results?)\b"
    r"|\bcode\s+as\s+it\s+is\s+now\b|\bthis\s+round's\s+code\b|\bwith\s+this\s+code\b",
    re.I,
)
"""Words that claim a figure measures the code as it stands, which no test checks."""


def current_claims(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [m.group(0) for m in CURRENT.finditer(flat)]


def test_no_doc_calls_a_figure_the_current_codes():
    bad = {str(d.relative_to(ROOT)): current_claims(d.read_text()) for d in readers()}
    bad = {d: c for d, c in bad.items() if c}
    assert not bad, f"name the commit a figure measured instead of: {bad}"


def test_a_current_code_claim_fails_the_check():
    readme = README.read_text()
    assert current_claims(readme) == []
    doctored = readme + "\n\nWith the current code, net-ids120 took 0.45 of torchrec's step.\n"
    assert current_claims(doctored) == ["the current code"]
    assert current_claims("the code as it is now\nran it") == ["code as it is now"]


# --- the README's length, the licence -------------------------------------------------------------


def too_long(text: str, limit: int = 900) -> bool:
    return len(text.split()) >= limit


def licence_problems(licence: str, pyproject: str, readme: str) -> list[str]:
    """Where LICENSE, pyproject.toml and README.md do not say BSD-3-Clause alike."""
    problems = []
    if not licence.startswith("BSD 3-Clause License") or "the torchrec-pipeline authors" not in licence:
        problems.append("LICENSE is not the BSD 3-Clause text of the torchrec-pipeline authors")
    m = re.search(r'^license\s*=\s*"([^"]*)"', pyproject, re.M)
    declared = m.group(1) if m else None
    if declared != "BSD-3-Clause":
        problems.append(f"pyproject.toml declares {declared!r}")
    if "BSD-3-Clause" not in readme:
        problems.append("README.md does not name the licence")
    return problems


def test_the_readme_is_short_and_names_the_licence_of_the_package():
    readme = README.read_text()
    assert not too_long(readme), f"README.md has {len(readme.split())} words; keep it under 900"
    licence, pyproject = (ROOT / "LICENSE").read_text(), (ROOT / "pyproject.toml").read_text()
    assert licence_problems(licence, pyproject, readme) == []


def test_a_long_readme_or_another_licence_fails_the_checks():
    readme = README.read_text()
    assert too_long(readme * 2)
    licence, pyproject = (ROOT / "LICENSE").read_text(), (ROOT / "pyproject.toml").read_text()
    other = pyproject.replace('license = "BSD-3-Clause"', 'license = "MIT"')
    assert other != pyproject
    assert licence_problems(licence, other, readme) == ["pyproject.toml declares 'MIT'"]
    assert len(licence_problems("MIT License", pyproject, readme.replace("BSD-3-Clause", "BSD"))) == 2
