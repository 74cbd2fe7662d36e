"""`python -m benchmarks figures` (`make figures`) plans from the files themselves, and every figure
file says which stack made it. Nothing here runs a benchmark: the plan is only listed, and where the
tool would run commands, running one fails the test.

- `--list` names every docs/results/*.md with the command on its `Command:` line.
- A results file without a `Command:` line stops the plan, naming the file (on a temporary copy of
  the folder, whose commands are pointed at the copy).
- Every results file's header names the pinned stack (the Makefile's) or holds a `Stack: previous`
  line; and every doc paragraph that quotes a previous-stack file says "previous stack".
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
    return [ROOT / "README.md", ROOT / "examples/dlrm/README.md", ROOT / "scripts/gpu/README.md",
            *sorted((ROOT / "docs").glob("*.md"))]  # fmt: skip


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
