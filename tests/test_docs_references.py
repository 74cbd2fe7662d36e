"""Every reference a reader of the docs would follow exists: the repository paths they name, the
dotted names of our packages (`pipeline.stages.schedule.ScheduleWatch`), the `make` targets and the
`python -m benchmarks` / `python -m timeline` subcommands, and every section a doc or the code names
(`docs/pipeline.md, "Checkpointing"`) is a heading of that file. `python -m benchmarks --help` and
docs/benchmarks.md's table list the same commands, and the doc lists the default loops `run --help`
points at. Each failure names the file, the line and the reference. Negative twins run the same
checkers on small synthetic texts with broken ones.

What counts as a path: a token with a `/` (or a file name with a known extension) that starts at a
top-level entry of the repository (`pipeline/stages/watch.py`, `docs/results/`), or, when it starts
elsewhere, a tail of a tracked path (`stages/watch.py`) or of a torchrec file (`torchrec/...`).
Markdown links resolve from the doc's folder. Skipped: URLs, absolute and home paths (`/tmp`,
`~/.cache/...`), outputs (`out/...`), placeholders (`DIR/rank{r}.json`, `<host>`, `...`, `*`).
A bare file name must be some tracked file's or torchrec file's name."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "rewrite", "tiered", "timeline", "tests.streamcheck", "benchmarks", "examples")
EXTENSIONS = ("py", "md", "sh", "toml", "json", "png", "svg", "tsv", "txt", "yml", "yaml", "cfg")


def docs() -> list[Path]:
    """The docs this test reads: the READMEs a reader starts from and every docs/*.md."""
    named = [ROOT / "README.md", ROOT / "examples/dlrm/README.md", ROOT / "scripts/gpu/README.md"]
    return named + sorted((ROOT / "docs").glob("*.md"))


@dataclass(frozen=True)
class Broken:
    doc: str
    line: int
    kind: str  # path, name, make, subcommand
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.kind} `{self.ref}`: {self.why}"


# --- what the repository has ------------------------------------------------------------------


@functools.cache
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """The repository's files and folders (tracked, or present on disk beside them), as posix paths."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = {line for line in out.splitlines() if line and (ROOT / line).exists()}
    dirs = {str(Path(f).parent.as_posix()) for f in files}
    for d in list(dirs):
        parts = d.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    dirs.discard(".")
    return frozenset(files), frozenset(dirs)


@functools.cache
def torchrec_files() -> tuple[frozenset[str], frozenset[str]]:
    """torchrec's installed files and folders, as `torchrec/...` paths (empty when not installed)."""
    spec = importlib.util.find_spec("torchrec")
    if spec is None or spec.origin is None:
        return frozenset(), frozenset()
    base = Path(spec.origin).parent.parent
    files, dirs = set(), set()
    for p in Path(spec.origin).parent.rglob("*"):
        if "__pycache__" in p.parts:
            continue
        (dirs if p.is_dir() else files).add(p.relative_to(base).as_posix())
    dirs.add("torchrec")
    return frozenset(files), frozenset(dirs)


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.\-$() ]+?)\s*:(?![=])", text, re.M):
        targets.update(t for t in m.group(1).split() if not t.startswith((".", "$")))
    return frozenset(targets)


@functools.cache
def subcommands(tool: str) -> frozenset[str]:
    if tool == "benchmarks":
        return frozenset(importlib.import_module("benchmarks.__main__")._SUBCOMMANDS)
    import argparse

    parser = importlib.import_module("timeline.cli")._parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return frozenset(action.choices)


def resolve_name(dotted: str) -> str | None:
    """None when `dotted` imports (its longest importable module prefix, then attributes along the
    rest); else why not."""
    parts = dotted.split(".")
    module, i = None, len(parts)
    while i > 0:
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name) and not err.name.startswith(name):
                return f"importing {name} fails: {err}"
            i -= 1
    if module is None:
        return f"no module {parts[0]}"
    obj = module
    for k, attr in enumerate(parts[i:], start=i):
        if not hasattr(obj, attr):
            return f"{'.'.join(parts[:k])} has no attribute {attr}"
        obj = getattr(obj, attr)
    return None


@functools.cache
def our_classes() -> dict[str, tuple[type, ...]]:
    """Every class our packages define, by its name (a name two classes share maps to both)."""
    import inspect
    import pkgutil

    found: dict[str, set[type]] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        modules = [root] + [
            importlib.import_module(info.name)
            for info in pkgutil.walk_packages(root.__path__, package + ".")
            if not info.name.endswith("__main__")
        ]
        for module in modules:
            for obj in vars(module).values():
                if inspect.isclass(obj) and obj.__module__.startswith(
                    tuple(p + "." for p in PACKAGES) + PACKAGES
                ):
                    found.setdefault(obj.__name__, set()).add(obj)
    return {name: tuple(classes) for name, classes in found.items()}


def _has(cls: type, attr: str) -> bool:
    """`attr` is on the class, a dataclass field or annotation, or set as `self.attr` in its code."""
    import inspect

    for klass in cls.__mro__:
        if klass is object:
            continue
        if attr in vars(klass) or attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(r"\bself\." + re.escape(attr) + r"\b\s*(:[^=\n]*)?=(?!=)", source):
            return True
    return False


def resolve_member(dotted: str) -> str | None:
    """For `Class.attr` where Class is one of ours: None when some class of that name has attr."""
    name, attr = dotted.split(".")[:2]
    classes = our_classes().get(name)
    if not classes or any(_has(c, attr) for c in classes):
        return None
    return f"{' nor '.join(sorted(c.__module__ + '.' + name for c in classes))} has no {attr}"


# --- reading a doc --------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"(?<!`)`([^`]+?)`(?!`)", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w./~$<{\-:@])(?:\.\./)*[\w.\-]+(?:/[\w.\-]+)*/?")
_DOTTED = re.compile(r"(?<![\w./\-])(?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+")
_MAKE = re.compile(r"(?<![\w\-/])make\s+(?:[A-Z_]+=\S*\s+)*([a-z][\w.\-]*)")
_MEMBER = re.compile(r"(?<![\w.])([A-Z]\w*)\.([a-z_]\w*)")
_DASH_M = re.compile(r"-m\s+(benchmarks|timeline)(?:\s+([a-z][\w\-]*)|(\.[\w.]+))?")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _code(text: str) -> list[tuple[int, str]]:
    """(offset, text) of each fenced block's body and each inline code span."""
    pieces = [(m.start(), m.group(0)) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    pieces += [(m.start(1), m.group(1)) for m in _SPAN.finditer(prose)]
    return pieces


def _prose(text: str) -> str:
    """The text outside code, the same length (code blanked), and without URLs."""
    text = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    text = _SPAN.sub(lambda m: " " * len(m.group(0)), text)
    return re.sub(r"\w+://\S+", lambda m: " " * len(m.group(0)), text)


def _is_path(token: str) -> bool:
    token = token.rstrip(".,;:")
    if "/" in token.strip("/"):
        return True
    if token.endswith("/") and len(token) > 1:
        return True
    return bool(re.fullmatch(r"[\w\-.]+\.(" + "|".join(EXTENSIONS) + ")", token))


def check_path(token: str, doc_dir: str, *, link: bool = False) -> str | None:
    """None when `token` names something that exists, or is not a repository path at all; else why."""
    token = token.split("#")[0].rstrip(".,;:")
    if not token or token.startswith(("/", "~", "$", "-")) or "://" in token:
        return None
    if any(c in token for c in "<>{}*[]") or "..." in token or re.search(r"(^|/)[A-Z][A-Z_0-9]*(/|$)", token):
        return None  # a placeholder: DIR/rank0.json, step-N/stores/
    files, dirs = tracked()
    tr_files, tr_dirs = torchrec_files()
    plain = token.rstrip("/")
    first = plain.split("/")[0]
    tops = {p.split("/")[0] for p in files}
    if link or first == "..":
        target = (Path(doc_dir) / plain).as_posix() if doc_dir else plain
        target = _normalise(target)
        if target is None:
            return "points outside the repository"
        return None if target in files or target in dirs else f"no {target} in the repository"
    if first in ("out", "tmp") or (first.startswith(".") and first not in tops):
        return None  # outputs and folders made where the code runs (.venv, .gpu)
    if first in tops:
        return None if plain in files or plain in dirs else "not in the repository"
    if first == "torchrec":
        return None if plain in tr_files or plain in tr_dirs or not tr_dirs else "not in torchrec"
    source = re.fullmatch(r"[\w\-.]+\.(py|md|sh)", plain.rsplit("/", 1)[-1]) is not None
    if "/" in plain:
        # ms/step, forward/backward: prose. A path starts at one of our folders or ends in a source file.
        if not source and first not in {d.rsplit("/", 1)[-1] for d in dirs}:
            return None
        tails = ("/" + plain, "/" + plain + ".py")
        if any(("/" + p).endswith(tails) for p in files | dirs | tr_files | tr_dirs):
            return None
        return "no tracked path (nor torchrec's) ends so"
    if not source:
        return None
    names = {p.rsplit("/", 1)[-1] for p in files | tr_files}
    return None if plain in names else "no tracked file (nor torchrec's) has this name"


def _normalise(path: str) -> str | None:
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def check_text(text: str, doc: str, doc_dir: str = "") -> list[Broken]:
    """Every broken reference in one doc's text; `doc_dir` is its folder, relative to the root."""
    broken: list[Broken] = []
    seen: set[tuple[int, str, str]] = set()

    def report(offset: int, kind: str, ref: str, why: str | None) -> None:
        line = _line(text, offset)
        if why is not None and (line, kind, ref) not in seen:
            seen.add((line, kind, ref))
            broken.append(Broken(doc, line, kind, ref, why))

    prose = _prose(text)
    for m in _LINK.finditer(prose):
        target = m.group(1)
        if "://" not in target and not target.startswith(("#", "mailto:")):
            report(m.start(1), "path", target, check_path(target, doc_dir, link=True))
    prose_no_links = _LINK.sub(lambda m: " " * len(m.group(0)), prose)
    for offset, piece, in_code in [(0, prose_no_links, False)] + [(o, p, True) for o, p in _code(text)]:
        clean = re.sub(r"\w+://\S+", lambda m: " " * len(m.group(0)), piece)
        for m in _PATH.finditer(clean):
            token = m.group(0)
            if _is_path(token) and not (not in_code and "/" not in token and "." not in token.rstrip(".")):
                where = clean[max(0, m.start() - 3) : m.start()]
                if where.endswith(("-m ", "python ")) and token.endswith(".py") is False:
                    continue
                report(offset + m.start(), "path", token.rstrip(".,;:"), check_path(token, doc_dir))
        if not in_code:
            continue
        for m in _DOTTED.finditer(clean):
            name = m.group(0)
            if name.rsplit(".", 1)[-1] in EXTENSIONS:
                continue
            if not clean[: m.start()].endswith("-m "):
                report(offset + m.start(), "name", name, resolve_name(name))
        for m in _MEMBER.finditer(clean):
            report(offset + m.start(), "member", m.group(0), resolve_member(m.group(0)))
        for m in _MAKE.finditer(clean):
            target = m.group(1)
            why = None if target in make_targets() else "no such target in the Makefile"
            report(offset + m.start(), "make", f"make {target}", why)
        for m in _DASH_M.finditer(clean):
            tool, sub, module = m.groups()
            if module:
                name = tool + module
                why = None if importlib.util.find_spec(name) else "no such module"
                report(offset + m.start(), "module", f"python -m {name}", why)
            elif sub:
                why = None if sub in subcommands(tool) else f"not a subcommand of python -m {tool}"
                report(offset + m.start(), "subcommand", f"python -m {tool} {sub}", why)
    return sorted(broken, key=lambda b: (b.line, b.kind, b.ref))


# --- sections named in docs and code: `docs/pipeline.md, "Checkpointing"` -------------------------

_SECTION = re.compile(
    r'((?:[\w\-]+/)*[\w\-]+\.md)(?:\s*,\s*|\s*\(\s*|\s*:\s*|\s+)"([^"]+)"((?:\s*(?:,|and|or)\s*"[^"]+")*)'
)


def _words(text: str) -> str:
    return " ".join(re.sub(r"[`*]", "", text).split()).lower()


def headings(path: Path) -> list[str]:
    """The headings of a Markdown file (outside code), as `_words` gives them."""
    text = _FENCE.sub("", path.read_text())
    return [_words(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)]


def check_sections(text: str, source: str) -> list[Broken]:
    """Every `<file>.md, "Section"` (also `<file>.md ("Section")`, `<file>.md, "A" and "B"`) in `text`,
    the content of the repository file `source`, whose file has no such heading. A heading matches
    a section named as it is, or as its start up to a colon, a comma or a parenthesis
    (`"PT2"` for "PT2: TrainPipelinePT2 and ..."); backticks and case do not count."""
    if source.endswith(".py"):  # a citation wrapped over comment lines
        text = re.sub(r"\n[ \t]*#", lambda m: "\n" + " " * (len(m.group(0)) - 1), text)
    broken = []
    here = (ROOT / source).parent
    for m in _SECTION.finditer(text):
        ref = m.group(1)
        target = next((p for p in (ROOT / ref, ROOT / "docs" / ref, here / ref) if p.is_file()), None)
        line = _line(text, m.start())
        if target is None:
            broken.append(Broken(source, line, "section", ref, "no such Markdown file"))
            continue
        known = headings(target)
        for section in [m.group(2), *re.findall(r'"([^"]+)"', m.group(3))]:
            want = _words(section)
            if not any(h == want or (h.startswith(want) and h[len(want)] in ":,( ") for h in known):
                why = f"{target.relative_to(ROOT).as_posix()} has no such heading"
                broken.append(Broken(source, line, "section", f'{ref}, "{" ".join(section.split())}"', why))
    return broken


def citing_files() -> list[Path]:
    """Every tracked file that may name a doc's section: Markdown, Python, shell, the Makefile (not
    the results files, nor this module, whose synthetic text names missing sections on purpose)."""
    files, _ = tracked()
    return [
        ROOT / f
        for f in sorted(files)
        if (f.endswith((".md", ".py", ".sh")) or f == "Makefile")
        and not f.startswith(("docs/results/", "docs/gpu-results/"))
        and f != "tests/test_docs_references.py"
    ]


def check_doc(path: Path) -> list[Broken]:
    rel = path.relative_to(ROOT).as_posix()
    doc_dir = rel.rsplit("/", 1)[0] if "/" in rel else ""
    return check_text(path.read_text(), rel, doc_dir)


# --- the tests ------------------------------------------------------------------------------------


def test_every_reference_in_the_docs_exists():
    broken = [b for path in docs() for b in check_doc(path)]
    assert not broken, f"{len(broken)} broken references:\n" + "\n".join(map(str, broken))


def test_every_section_a_doc_or_the_code_names_exists():
    broken = [
        b
        for path in citing_files()
        for b in check_sections(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert not broken, f"{len(broken)} sections named that no heading has:\n" + "\n".join(map(str, broken))


def test_the_section_check_reports_what_is_missing():
    text = (
        'See docs/pipeline.md, "Checkpointing", and docs/reference.md ("PT2").\n'
        'Also docs/pipeline.md, "Input_dist schedules" and "No such\nsection".\n'
        'The guide, docs/pipeline.md, "Over a 1 Gbit link", is in benchmarks.md.\n'
        'benchmarks.md, "Over a 1 Gbit link"; reference.md, "`execute_all_batches=False`".\n'
        'docs/nowhere.md, "Anything".\n'
    )
    got = {(b.line, b.ref, b.why) for b in check_sections(text, "docs/synthetic.md")}
    assert got == {
        (2, 'docs/pipeline.md, "No such section"', "docs/pipeline.md has no such heading"),
        (4, 'docs/pipeline.md, "Over a 1 Gbit link"', "docs/pipeline.md has no such heading"),
        (6, "docs/nowhere.md", "no such Markdown file"),
    }, got
    docstring = '"""A note (docs/pipeline.md, "When a\n    rank fails")."""\n'
    wrapped = docstring + '# docs/pipeline.md, "When a\n# rank fails"\n'
    assert check_sections(wrapped, "tests/x.py") == []
    assert len(check_sections(wrapped.replace("rank fails", "rank wins"), "tests/x.py")) == 2


def test_the_docs_read_are_there():
    for path in docs():
        assert path.is_file(), path


SYNTHETIC = """\
# A doc with broken references

The watch lives in `pipeline/stages/no_such_file.py`, beside pipeline/stages/watch.py
and tests/test_no_such_test.py.

Its class is `pipeline.stages.watch.NoSuchWatch`; the module `pipeline.no_such_module` is gone.
`Ranks.no_such_method` was removed, and so was pipeline/stages/no_such_file.py.

Run `make no-such-target`, or `python -m benchmarks no-such-sub`, or `python -m timeline nope`.

See [the guide](no_such_guide.md) and [the figure](img/none.png).

```
make lint
.venv/bin/python -m benchmarks.no_such_module
```

Fine: `pipeline/stages/watch.py`, `pipeline.stages.schedule.ScheduleWatch`, `make test`, `python -m benchmarks
run`, https://example.com/a/b.py, `~/.cache/torchrec-pipeline/costs-<host>.json`, `/tmp/x.py`,
`out/bench/results.md`, `DIR/rank{r}.json`, [the pipeline doc](pipeline.md).
"""


def test_the_checker_reports_each_broken_reference_with_its_doc_and_line():
    broken = check_text(SYNTHETIC, "docs/synthetic.md", "docs")
    got = {(b.line, b.kind, b.ref) for b in broken}
    assert got == {
        (3, "path", "pipeline/stages/no_such_file.py"),
        (4, "path", "tests/test_no_such_test.py"),
        (6, "name", "pipeline.stages.watch.NoSuchWatch"),
        (6, "name", "pipeline.no_such_module"),
        (7, "member", "Ranks.no_such_method"),
        (7, "path", "pipeline/stages/no_such_file.py"),
        (9, "make", "make no-such-target"),
        (9, "subcommand", "python -m benchmarks no-such-sub"),
        (9, "subcommand", "python -m timeline nope"),
        (11, "path", "no_such_guide.md"),
        (11, "path", "img/none.png"),
        (15, "module", "python -m benchmarks.no_such_module"),
    }, "\n".join(map(str, broken))
    text = "\n".join(map(str, broken))
    assert "docs/synthetic.md:3: path `pipeline/stages/no_such_file.py`" in text
    assert "has no attribute NoSuchWatch" in text


def test_what_the_checker_counts_as_a_path():
    assert check_path("pipeline/stages/watch.py", "") is None
    assert check_path("stages/watch.py", "") is None  # a tail of a tracked path
    assert check_path("pipeline/context.py", "") is not None
    assert check_path("~/.cache/torchrec-pipeline/", "") is None
    assert check_path("results/", "docs", link=True) is None
    assert check_path("../README.md", "docs", link=True) is None
    assert check_path("../../elsewhere/NOTES.md", "docs", link=True) is not None


# --- docs/benchmarks.md and `python -m benchmarks --help` -----------------------------------------


def listed_commands(help_text: str) -> list[str]:
    """The subcommands `python -m benchmarks --help` lists first, one a line (`    run   ...`)."""
    return re.findall(r"^    ([a-z][\w\-]*)\s{2,}\S", help_text.split("positional arguments:")[0], re.M)


def documented_commands(text: str) -> list[str]:
    """The subcommands in docs/benchmarks.md's table of commands (its rows `python -m benchmarks X`)."""
    return re.findall(r"^\| `python -m benchmarks ([a-z][\w\-]*)` \|", text, re.M)


def test_the_benchmarks_help_and_docs_list_the_same_commands(capsys):
    from benchmarks.__main__ import _SUBCOMMANDS, main

    with pytest.raises(SystemExit):
        main(["--help"])
    helped = listed_commands(capsys.readouterr().out)
    documented = documented_commands((ROOT / "docs" / "benchmarks.md").read_text())
    assert sorted(helped) == sorted(_SUBCOMMANDS), (
        f"--help lists {helped}; the tool has {sorted(_SUBCOMMANDS)}"
    )
    assert sorted(documented) == sorted(helped), f"docs/benchmarks.md lists {documented}; --help {helped}"
    assert len(documented) == len(set(documented)), documented


def test_the_command_lists_are_read_as_they_should():
    help_text = (
        "usage: x\n\n    run         configs\n    hit-rates   each\n\npositional arguments:\n    sweep  x\n"
    )
    assert listed_commands(help_text) == ["run", "hit-rates"]
    doc = "| command | what |\n|---|---|\n| `python -m benchmarks run` | a |\n"
    doc += "| `python -m benchmarks sweep` | b |\n"
    assert documented_commands(doc) == ["run", "sweep"]
    assert documented_commands(doc.replace("| `python -m benchmarks sweep` | b |\n", "")) == ["run"]


def test_docs_benchmarks_md_names_runs_default_loops():
    """`run --help` says its default loops are "docs/benchmarks.md's N": the doc lists those N."""
    import argparse

    from benchmarks.__main__ import _SUBCOMMANDS
    from benchmarks.spec import VARIANTS

    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    m = re.search(r"Without `--variants`, `run` compares these (\d+): ((?:`[\w\-]+`(?:, )?)+)", text)
    assert m, "docs/benchmarks.md does not list run's default loops"
    assert int(m.group(1)) == len(VARIANTS), m.group(0)
    assert re.findall(r"`([\w\-]+)`", m.group(2)) == list(VARIANTS), m.group(0)
    parser = argparse.ArgumentParser()
    _SUBCOMMANDS["run"][0](parser)
    (variants,) = [a for a in parser._actions if "--variants" in a.option_strings]
    assert f"docs/benchmarks.md's {len(VARIANTS)}" in variants.help, variants.help


def test_the_user_guide_stays_of_readable_length():
    """docs/pipeline.md is the user guide; the per-class details, streams and schedules' internals
    belong in docs/reference.md (what `wc -w` counts)."""
    words = len((ROOT / "docs" / "pipeline.md").read_text().split())
    assert words <= 6000, f"docs/pipeline.md has {words} words; move reference material to docs/reference.md"
