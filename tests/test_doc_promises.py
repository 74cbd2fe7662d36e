"""Promises of the docs that drift when the code or the results change, each checked against its
source, each with a twin that runs the same check on a doctored copy of the text and must fail:

- the default input_dist schedule the docs name is the one `pipeline/config.py` declares, and no
  line calls torchrec's order the default;
- a results file measured under an older default, or an earlier rule of the default, says so in its
  first line; a file that does not say so and times our pipelines at the default has the default's
  `watch` record in every such run of its JSON; and every paragraph of the docs that quotes a marked
  file says so too;
- the README's times are those of the committed file `make time-fresh-clone` writes (until that file
  exists, the README quotes no time and says how to make it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.options import SCHEDULE_NAMES, InputDistOptions
from tests.test_figures import citing_blocks

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
FRESH_CLONE = RESULTS / "fresh-clone.json"
DEFAULT = InputDistOptions().schedule
"""The default schedule, as the code declares it."""


def schedule_docs() -> list[Path]:
    """The docs that name the default schedule: the README, the guide, the reference, the figures."""
    return [
        ROOT / "README.md",
        *(ROOT / "docs" / f for f in ("pipeline.md", "reference.md", "benchmarks.md")),
    ]


# --- the default's name ---------------------------------------------------------------------------

_NAME = "|".join(re.escape(n) for n in SCHEDULE_NAMES)
_CLAIMS = (
    re.compile(rf'`?(?:input_dist_schedule=)?"({_NAME})"`?,?\s+(?:\()?the\s+default\b'),
    re.compile(rf'\b[Tt]he\s+default(?:\s+schedule)?(?:,|:|\s+is)?\s+`?(?:input_dist_schedule=)?"({_NAME})"'),
)
_STALE = re.compile(
    r"(?<!older\s)default,?\s+\(?torchrec's\s+order|default\s+is\s+torchrec's\s+order"
    r"|torchrec's\s+order\s+\(the\s+default"
    r"|torchrec's\s+order\s+by\s+default"
)


def default_claims(text: str) -> tuple[set[str], list[str]]:
    """The schedule names `text` calls the default, and its lines that call torchrec's order so."""
    flat = " ".join(text.split())
    names = {m.group(1) for pattern in _CLAIMS for m in pattern.finditer(flat)}
    stale = [m.group(0) for m in _STALE.finditer(flat)]
    return names, stale


def test_the_docs_name_the_default_the_code_declares():
    assert DEFAULT in SCHEDULE_NAMES
    for doc in schedule_docs():
        names, stale = default_claims(doc.read_text())
        assert names == {DEFAULT}, f"{doc.name} calls {sorted(names)} the default; the code's is {DEFAULT!r}"
        assert not stale, f"{doc.name} calls torchrec's order the default: {stale}"


def test_a_stale_default_in_a_doc_fails_the_check():
    text = (ROOT / "README.md").read_text()
    assert default_claims(text) == ({DEFAULT}, [])
    other = next(n for n in SCHEDULE_NAMES if n != DEFAULT)
    names, _ = default_claims(text.replace(f'"{DEFAULT}"', f'"{other}"'))
    assert other in names and DEFAULT not in names
    _, stale = default_claims(text + "\n\nOur SparseDist (default, torchrec's order) runs it.\n")
    assert stale == ["default, torchrec's order"]


# --- results files measured under an older default ------------------------------------------------

OLDER = re.compile(
    r'^Measured under (?:an older default: input_dist_schedule "(?P<old>[\w-]+)"'
    r'|an earlier rule of the default "(?P<rule>[\w-]+)")'
)
"""The first line of a results file measured under another default, or an earlier rule of it."""


def marked(text: str) -> bool:
    """Whether a results file's first line says it was measured under an older default or rule."""
    m = OLDER.match(text)
    if m is None:
        return False
    assert (m.group("old") or m.group("rule")) in SCHEDULE_NAMES, text.splitlines()[0]
    assert m.group("rule") in (None, DEFAULT), f"{text.splitlines()[0]}: not the code's default"
    return True


def unwatched_runs(runs: object) -> list[str]:
    """Our pipelines' runs at the default schedule (no `@SCHEDULE`) that hold no `watch` record."""
    if not isinstance(runs, list):
        return []
    ours = [r for r in runs if str(r.get("variant", "")).startswith("ours-") and "@" not in r["variant"]]
    return [f"{r['config']} / {r['variant']} round {r.get('round')}" for r in ours if "watch" not in r]


def test_a_results_file_not_marked_older_ran_under_the_default():
    bad = []
    for md in sorted(RESULTS.glob("*.md")):
        data = md.with_suffix(".json")
        if marked(md.read_text()) or not data.is_file():
            continue
        missing = unwatched_runs(json.loads(data.read_text()).get("runs"))
        if missing:
            bad.append(f"{md.name}: {len(missing)} runs without the default's watch, e.g. {missing[0]}")
    assert not bad, "say `Measured under an older default: ...` in the first line of:\n" + "\n".join(bad)


def unmarked_quotes(text: str, older: set[str]) -> list[str]:
    """Each paragraph (and the ones after it that it governs) quoting a file of `older` that does not
    say "older default" or "earlier rule": `<line>: <file>`."""
    found = []
    for line, block, cited in citing_blocks(text):
        said = re.search(r"older\s+default|earlier\s+rule", block, re.I)
        for name in cited:
            if name.split("/", 1)[1] in older and not said:
                found.append(f"{line}: {name}")
    return found


def older_files() -> set[str]:
    return {p.name for p in RESULTS.glob("*.md") if marked(p.read_text())}


def test_the_docs_say_so_where_they_quote_an_older_default():
    bad = [
        f"{doc.relative_to(ROOT)}:{q}"
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for q in unmarked_quotes(doc.read_text(), older_files())
    ]
    assert not bad, "paragraphs quoting a file of an older default without saying so:\n" + "\n".join(bad)


def test_the_older_default_checks_fail_on_a_stale_line(tmp_path):
    # A file of the old default with its first line removed: its runs have no watch record.
    speed = RESULTS / "speed-1gbit.md"
    assert marked(speed.read_text())
    unmarked = speed.read_text().split("\n", 2)[2]
    assert not marked(unmarked)
    assert unwatched_runs(json.loads(speed.with_suffix(".json").read_text())["runs"])
    # A paragraph quoting it without saying so.
    doc = "## Speed\n\nOur SparseDist took 0.99 of torchrec's step ([the run](results/speed-1gbit.md)).\n"
    assert [q.split(": ")[1] for q in unmarked_quotes(doc, {"speed-1gbit.md"})] == ["results/speed-1gbit.md"]
    assert unmarked_quotes(doc.replace("took", "took, under an older default,"), {"speed-1gbit.md"}) == []
    if DEFAULT != "late":
        with pytest.raises(AssertionError, match="not the code's default"):
            marked('Measured under an earlier rule of the default "late": ...')


# --- the README's times ---------------------------------------------------------------------------

_DURATION = re.compile(r"\b(\d+) min(?: (\d+) s)?\b|\b(\d+(?:\.\d+)?) s\b")


def duration(seconds: float) -> str:
    """How the README writes a time: `6 min 47 s`, `52 s`."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{whole} s"


def readme_time_problems(readme: str, record: dict | None) -> list[str]:
    """What is wrong with the README's times given the fresh-clone record (None: no file yet)."""
    prose = re.sub(r"```.*?```", " ", readme, flags=re.S)
    quoted = [m.group(0) for m in _DURATION.finditer(" ".join(prose.split()))]
    if record is None:
        problems = [f"quotes {t} with no committed file of times" for t in quoted]
        if "make time-fresh-clone" not in readme:
            problems.append("says neither the times nor how to record them (make time-fresh-clone)")
        return problems
    times = {t["target"]: duration(t["seconds"]) for t in record["targets"] if t["status"] == 0}
    problems = [
        f"quotes {t}, which the file does not hold ({times})" for t in quoted if t not in times.values()
    ]
    problems += [f"does not quote make {k}'s {v}" for k, v in times.items() if v not in quoted]
    if "fresh-clone.json" not in readme:
        problems.append("does not name the file its times come from")
    return problems


def test_the_readme_times_come_from_the_committed_file():
    record = json.loads(FRESH_CLONE.read_text()) if FRESH_CLONE.is_file() else None
    problems = readme_time_problems((ROOT / "README.md").read_text(), record)
    assert not problems, "README.md:\n" + "\n".join(problems)


def test_a_readme_time_not_in_the_file_fails_the_check():
    record = {
        "targets": [
            {"target": "setup", "seconds": 85.2, "status": 0},
            {"target": "test", "seconds": 407.0, "status": 0},
        ]
    }
    good = "From docs/results/fresh-clone.json: set-up 1 min 25 s, `make test` 6 min 47 s."
    assert readme_time_problems(good, record) == []
    stale = good.replace("6 min 47 s", "7 to 9.5 minutes, 6 min 50 s")
    assert any("6 min 50 s" in p for p in readme_time_problems(stale, record))
    assert any("test's 6 min 47 s" in p for p in readme_time_problems(stale, record))
    assert readme_time_problems("Run make time-fresh-clone to record them.", None) == []
    assert readme_time_problems("It takes about 20 s; make time-fresh-clone.", None) == [
        "quotes 20 s with no committed file of times"
    ]
