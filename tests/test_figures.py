"""`python -m benchmarks figures` (`make figures`) plans from the files themselves, and every figure
file says which stack made it. Nothing here runs a benchmark: the plan is only listed, and where the
tool would run commands, running one fails the test.

- `--list` names every docs/results/*.md with the command on its `Command:` line.
- A results file without a `Command:` line stops the plan, naming the file (on a temporary copy of
  the folder, whose commands are pointed at the copy).
- Every results file's header names the pinned stack (the Makefile's) or holds a `Stack: previous`
  line; and every doc paragraph that quotes a previous-stack file says "previous stack".
- Every number in README.md, examples/dlrm/README.md and docs/*.md that stands in a paragraph citing a
  results file (`docs/results/` or `docs/gpu-results/`), or after it in the same section, is in a
  file that paragraph cites; a `median [lowest, highest]` figure must be there as the same three
  numbers together. Its twins: a figure changed in the doc, or in the results file, fails the check.
  What it cannot see: a number taken from the wrong column or row of the right file.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def _command_line(path: Path) -> str:
    m = re.search(r"^Command: `([^`]+)`", path.read_text(), re.M)
    assert m, f"{path.name}: no Command line"
    return " ".join(m.group(1).split())


def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"the figures tool ran a command: {args}")

    monkeypatch.setattr(figures.subprocess, "run", refuse)


def _copy(tmp_path: Path) -> Path:
    """docs/results copied to `tmp_path`, every command's output paths pointed at the copy."""
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    for md in copy.glob("*.md"):
        md.write_text(md.read_text().replace("docs/results/", f"{copy}/"))
    return copy


def test_list_names_every_results_file_with_its_command(capsys, monkeypatch):
    _no_runs(monkeypatch)
    assert main(["figures", "--list"]) == 0
    out = capsys.readouterr().out
    files = sorted(RESULTS.glob("*.md"))
    assert files
    for path in files:
        command = _command_line(path)
        assert f"{path.name}  [" in out, path.name
        assert f"    {command}\n" in out, f"{path.name}: its command is not listed"
        assert f"--md docs/results/{path.name}" in command, f"{path.name}: its command writes elsewhere"


def test_a_results_file_without_a_command_stops_the_plan(tmp_path, capsys, monkeypatch):
    _no_runs(monkeypatch)
    copy = _copy(tmp_path)
    assert main(["figures", "--list", "--results", str(copy)]) == 0  # the copy's plan is whole
    capsys.readouterr()
    vote = copy / "vote.md"
    lines = vote.read_text().splitlines()
    vote.write_text("\n".join(line for line in lines if not line.startswith("Command:")))
    for argv in (["figures", "--list"], ["figures"]):
        assert main([*argv, "--results", str(copy)]) == 2
        err = capsys.readouterr().err
        assert "vote.md: no `Command:` line" in err, err
        assert err.count("\n  ") == 1, f"only vote.md should be named:\n{err}"


def test_a_command_writing_elsewhere_stops_the_plan(tmp_path, capsys, monkeypatch):
    _no_runs(monkeypatch)
    copy = _copy(tmp_path)
    vote = copy / "vote.md"
    vote.write_text(vote.read_text().replace(f"--md {copy}/vote.md", "--md out/bench/vote.md"))
    assert main(["figures", "--results", str(copy)]) == 2
    assert "vote.md: its command writes its Markdown to out/bench/vote.md" in capsys.readouterr().err


def test_commands_that_emulate_a_link_need_root():
    need = {f.path.name for f in figures.plan() if f.needs_root}
    for path in RESULTS.glob("*.md"):
        argv = _command_line(path).split()
        emulates = "--link" in argv or argv[3] == "sweep"
        assert (path.name in need) == emulates, path.name


# --- the stack each file states, and the docs that quote it ---------------------------------------


def docs() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "examples/dlrm/README.md",
        ROOT / "scripts/gpu/README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]


def unmarked_quotes(text: str, previous: set[str]) -> list[str]:
    """Each paragraph of `text` that names a previous-stack results file (`results/<name>.md`) and does
    not say "previous stack": `<line>: <name>`."""
    found = []
    offset = 0
    for paragraph in re.split(r"\n\s*\n", text):
        line = text.count("\n", 0, text.index(paragraph, offset)) + 1
        offset = text.index(paragraph, offset) + len(paragraph)
        said = re.search(r"previous\s+stack", paragraph, re.I)
        for name in sorted(set(re.findall(r"results/([\w.\-]+\.md)", paragraph)) & previous):
            if not said:
                found.append(f"{line}: {name}")
    return found


def test_every_results_file_names_the_pinned_stack_or_says_it_is_previous():
    pinned = figures.pinned_stack()
    assert pinned == {"torch": "2.14.1", "torchrec": "1.9.2", "fbgemm-gpu-cpu": "1.9.0"}
    files = sorted(RESULTS.glob("*.md"))
    unstated = [p.name for p in files if figures.stack_of(p.read_text(), pinned) is None]
    assert not unstated, f"say the stack (or {figures.PREVIOUS!r}) in the header of: {unstated}"


def test_docs_that_quote_a_previous_stack_file_say_so():
    pinned = figures.pinned_stack()
    previous = {p.name for p in RESULTS.glob("*.md") if figures.stack_of(p.read_text(), pinned) == "previous"}
    bad = [f"{d.relative_to(ROOT)}:{q}" for d in docs() for q in unmarked_quotes(d.read_text(), previous)]
    assert not bad, "these paragraphs quote a previous-stack file without saying so:\n" + "\n".join(bad)


def test_the_stack_checks_fail_where_they_should():
    pinned = {"torch": "2.14.1", "torchrec": "1.9.2", "fbgemm-gpu-cpu": "1.9.0"}
    current = "Command: `x`  \nMachine: AMD; torch 2.14.1, torchrec 1.9.2, fbgemm-gpu-cpu 1.9.0\n\n| a |\n"
    assert figures.stack_of(current, pinned) == "pinned"
    assert figures.stack_of(current.replace("1.9.2", "1.9.20"), pinned) is None
    old = "Command: `x`  \nStack: previous (torchrec 1.8.0)\nMachine: torch 2.13.0\n\n| a |\n"
    assert figures.stack_of(old, pinned) == "previous"
    assert figures.stack_of(old.replace("Stack: previous", "Stack: older"), pinned) is None
    assert figures.stack_of(old + "\n" + current, pinned) == "previous"  # only the header counts
    assert figures.stack_of(current.replace("Machine", "Stack: previous\nMachine"), pinned) is None
    doc = "Quoted: [t](results/old.md), previous stack.\n\nQuoted: results/old.md.\n\n[n](results/new.md)"
    assert unmarked_quotes(doc, {"old.md"}) == ["3: old.md"]


# --- every figure quoted beside a results file is in that file ------------------------------------

_CITE = re.compile(r"(?:docs/)?((?:gpu-)?results)/([\w.\-]+\.md)")
_NUM = r"[+\-]?\d+(?:,\d{3})*(?:\.\d+)?"
_SPREAD = re.compile(rf"(?<![\w.])({_NUM})x?\s*\[\s*({_NUM})\s*,\s*({_NUM})\s*\]")
_DOC_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?=x\b|[^\w]|$)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"(?<!`)`[^`]+?`(?!`)", re.S)


def quoting_docs() -> list[Path]:
    """The docs whose figures are checked against their results files."""
    return [ROOT / "README.md", ROOT / "examples/dlrm/README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _plain(number: str) -> str:
    return number.replace(",", "").lstrip("+")


def _spread(m: re.Match) -> tuple[str, str, str]:
    return tuple(_plain(g) for g in m.groups())


def figures_in(text: str) -> tuple[set[tuple[str, str, str]], set[str]]:
    """What a results file holds: its `median [lowest, highest]` figures (also as three cells side by
    side in a table row), and every number in it (digits inside words included: `1gbit` holds 1)."""
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    spreads = {_spread(m) for m in _SPREAD.finditer(text)}
    for row in re.findall(r"^\|.*\|$", text, re.M):  # a median, min and max in three cells side by side
        cells = [c.strip() for c in row.strip("|").split("|")]
        for i in range(len(cells) - 2):
            if all(re.fullmatch(_NUM, c) for c in cells[i : i + 3]):
                spreads.add(tuple(_plain(c) for c in cells[i : i + 3]))
    return spreads, set(re.findall(r"\d+(?:\.\d+)?", text))


def citing_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, text, cited files as `results/x.md` or `gpu-results/x.md`) of each run of paragraphs
    from one that cites a results file to the next heading or the next paragraph citing another: the
    tables and remarks after a citation quote the files it names."""
    text = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    paragraphs = [(m.start(), m.group(0)) for m in re.finditer(r"(?:[^\n]|\n(?!\s*\n))+", text)]
    blocks: list[tuple[int, str, list[str]]] = []
    open_block = False
    for start, para in paragraphs:
        cited = sorted({f"{folder}/{name}" for folder, name in _CITE.findall(para)})
        if para.lstrip().startswith("#"):
            open_block = False
        elif cited:
            blocks.append((text.count("\n", 0, start) + 1, para, cited))
            open_block = True
        elif open_block:
            line, block, files = blocks[-1]
            blocks[-1] = (line, block + "\n\n" + para, files)
    return blocks


def unfiled_figures(text: str, docs_dir: Path) -> list[str]:
    """Each number of `text` (a doc) quoted in a paragraph that cites a results file, or after it in
    the same section, that none of the files it cites holds: `<line>: <number> not in <files>`. A
    `median [lowest, highest]` figure must be in a file as the same three numbers together; any other
    number must be in one of the files. Code, links' targets and the citations are not read."""
    found = []
    for line, block, cited in citing_blocks(text):
        spreads: set[tuple[str, str, str]] = set()
        numbers: set[str] = set()
        for name in cited:
            path = docs_dir / name
            if not path.is_file():
                found.append(f"{line}: cites {name}, which does not exist")
                continue
            s, n = figures_in(path.read_text())
            spreads |= s
            numbers |= n
        prose = _CODE.sub(" ", _FENCE.sub(" ", block))
        prose = _CITE.sub(" ", re.sub(r"\]\([^)\s]*\)", "]", prose))
        prose = re.sub(r"\w+://\S+", " ", prose)
        for m in _SPREAD.finditer(prose):
            if _spread(m) not in spreads:
                found.append(f"{line}: {m.group(0)} not in {', '.join(cited)}")
        for m in _DOC_NUMBER.finditer(_SPREAD.sub(" ", prose)):
            if _plain(m.group(0)) not in numbers:
                found.append(f"{line}: {m.group(0)} not in {', '.join(cited)}")
    return found


def test_every_figure_quoted_beside_a_results_file_is_in_it():
    bad = [
        f"{d.relative_to(ROOT)}:{p}"
        for d in quoting_docs()
        for p in unfiled_figures(d.read_text(), ROOT / "docs")
    ]
    assert not bad, "figures quoted beside a results file that the file does not hold:\n" + "\n".join(bad)


def _copy_docs(tmp_path: Path) -> Path:
    """docs/results and docs/gpu-results copied under `tmp_path`/docs."""
    docs_dir = tmp_path / "docs"
    for folder in ("results", "gpu-results"):
        if (ROOT / "docs" / folder).is_dir():
            shutil.copytree(ROOT / "docs" / folder, docs_dir / folder)
    return docs_dir


def _a_quoted_figure() -> tuple[str, str, str]:
    """(doc text, a `median [lowest, highest]` figure it quotes, the results file holding it once):
    the first such figure of docs/benchmarks.md whose three numbers appear once in that file and in
    no other file its paragraph cites."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for _, block, cited in citing_blocks(text):
        for m in _SPREAD.finditer(_CODE.sub(" ", block)):
            counts = {name: (ROOT / "docs" / name).read_text().count(m.group(0)) for name in cited}
            for name in cited:
                if counts[name] == 1 == sum(counts.values()) and "x" not in m.group(0):
                    return text, m.group(0), name
    raise AssertionError("docs/benchmarks.md quotes no figure to alter")


def _altered(figure: str) -> str:
    """`figure` with its lowest round moved by 0.01 (a number no results file is likely to pair)."""
    m = _SPREAD.fullmatch(figure)
    low = m.group(2)
    moved = f"{float(low) + 0.01:.{len(low.split('.')[-1]) if '.' in low else 0}f}"
    return figure.replace(f"[{low},", f"[{moved},", 1)


def test_a_figure_changed_in_the_doc_fails_the_check(tmp_path):
    text, figure, name = _a_quoted_figure()
    docs_dir = _copy_docs(tmp_path)
    assert unfiled_figures(text, docs_dir) == []
    changed = _altered(figure)
    bad = unfiled_figures(text.replace(figure, changed, 1), docs_dir)
    assert len(bad) == 1 and f"{changed} not in " in bad[0] and name in bad[0], bad


def test_a_figure_changed_in_its_results_file_fails_the_check(tmp_path):
    text, figure, name = _a_quoted_figure()
    docs_dir = _copy_docs(tmp_path)
    held = docs_dir / name
    held.write_text(held.read_text().replace(figure, _altered(figure)))
    bad = unfiled_figures(text, docs_dir)
    assert any(f"{figure} not in " in b for b in bad), bad


def test_the_figure_check_reads_numbers_as_it_should(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "x.md").write_text(
        "Command: `x`  \nMachine: 2 cores; over 1gbit\n\n| variant | ms | min | max |\n|---|---:|---:|---:|\n"
        "| a | 0.73 [0.65, 0.78] | 7,230 | +0.084 [-0.088, +0.198] |\n| b | 23 | 17 | 30 |\n"
    )
    doc = (
        "Intro: 3 tables of 500 rows, no citation here.\n\n"
        "Over 1 Gbit ([results/x.md](results/x.md)): 0.73x [0.65, 0.78], 7,230 samples/s, "
        "+0.084 [-0.088, +0.198] ms; first step 23 [17, 30] (`--steps 99` is code).\n\n"
        "| a | 0.73 [0.65, 0.78] |\n\nA remark on it: 7230.\n\n## Next\n\nFree again: 12.5 ms.\n"
    )
    assert unfiled_figures(doc, tmp_path / "docs") == []
    for old, new, why in (
        ("0.73x [0.65, 0.78]", "0.73x [0.65, 0.79]", "0.73x [0.65, 0.79] not in results/x.md"),
        ("23 [17, 30]", "17 [23, 30]", "17 [23, 30] not in results/x.md"),  # the three cells, in order
        ("| a | 0.73 [0.65, 0.78] |", "| a | 0.74 |", "0.74 not in results/x.md"),  # a table after it
        ("A remark on it: 7230.", "A remark on it: 7231.", "7231 not in results/x.md"),  # same section
        (
            "[results/x.md](results/x.md)",
            "[results/y.md](results/y.md)",
            "cites results/y.md, which does not",
        ),
    ):
        bad = unfiled_figures(doc.replace(old, new), tmp_path / "docs")
        assert any(why in b for b in bad), (old, bad)
