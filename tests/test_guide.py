"""docs/pipeline.md as a new user follows it: its complete script is examples/quickstart.py, which
trains on 2 gloo ranks; every word of its glossary is defined before the guide first uses it; its
list of constructors is each class's signature. Each doc check has a twin that runs it on a doctored
copy of the text and must fail.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import pipeline
from tests.harness import pytest_timeout, run_script, script_job

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "pipeline.md"
SCRIPT = ROOT / "examples" / "quickstart.py"

# --- the complete script --------------------------------------------------------------------------


def script_block(guide: str) -> str:
    """The Python block of the guide's "A complete script" section."""
    section = guide[guide.index("\n## A complete script\n") :].split("\n## ", 2)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, 'docs/pipeline.md, "A complete script", has no python block'
    return m.group(1)


def script_body(source: str) -> str:
    """examples/quickstart.py without its module docstring: what the guide shows."""
    return source[source.index('"""', 3) + 3 :].lstrip("\n")


def test_the_guide_shows_the_script_that_runs():
    assert script_block(GUIDE.read_text()) == script_body(SCRIPT.read_text())


def test_a_changed_script_line_fails_the_comparison():
    guide = GUIDE.read_text()
    stale = guide.replace(
        "pipe = TrainPipelineSparseDist(model, optimizer, device)\n", "pipe = make(model)\n", 1
    )
    assert stale != guide
    assert script_block(stale) != script_body(SCRIPT.read_text())


@pytest.mark.slow
@pytest.mark.timeout(pytest_timeout(180))
def test_the_script_trains_on_2_gloo_ranks():
    ranks = run_script("examples.quickstart", [], 2, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert [status for status, _ in ranks] == [0, 0], script_job(ranks).stderr
    out = ranks[0][1]
    assert re.search(r"trained 20 batches, last loss \d+\.\d+", out), out
    assert re.search(r"model\.sparse_arch\.embedding_bag_collection\s+yes\s+traced", out), out
    assert "input_dist schedule: adaptive" in out, out


# --- the glossary ---------------------------------------------------------------------------------

TERMS = {
    "plain loop": r"plain loop",
    "in flight": r"in flight",
    "head batch": r"head batch",
    "fill": r"fill",
    "input_dist": r"input_dist",
    "splits": r"splits",
    "schedule": r"schedules?",
    "early": r"early",
    "late": r"late",
    "lane": r"lanes?",
    "status word": r"status words?",
    "agreement": r"agreement",
    "rides": r"rides|riding|ride",
    "carried": r"carried",
    "vote": r"votes?|voted",
    "admitted": r"admits?|admitted",
    "watch": r"watch(?:es)?",
    "blocked share": r"blocked shares?",
    "figure": r"figures?",
    "verdict": r"verdicts?",
    "settle": r"settle[ds]?",
    "ticket": r"tickets?",
    "status row": r"status rows?",
    "narrowing": r"narrow(?:ing|ed)",
    "look-ahead": r"look-ahead",
    "ahead": r"ahead",
    "inline": r"inline",
    "postproc": r"postprocs?",
    "rewrite report": r"rewrite report",
    "drain": r"drain",
}
"""Each word the glossary must define (as `**word**`), and how the guide may spell it."""


def prose(text: str) -> str:
    """`text` with code blocks, code spans and links' targets blanked (offsets kept)."""
    text = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r"^    .*$", lambda m: " " * len(m.group(0)), text, flags=re.M)
    return re.sub(r"`[^`\n]*`|\]\([^)]*\)", lambda m: " " * len(m.group(0)), text)


def glossary_problems(guide: str) -> list[str]:
    """Each glossary word not defined there, or used in the guide before the glossary."""
    start = guide.index("\n## Words used here\n")
    end = guide.index("\n## ", start + 1)
    glossary = guide[start:end]
    flat = prose(guide)
    problems = []
    for word, spelling in TERMS.items():
        if f"**{word}**" not in glossary:
            problems.append(f"{word}: not defined in the glossary")
        first = re.search(rf"(?<![\w-])(?:{spelling})(?![\w-])", flat, re.I)
        if first and first.start() < start:
            line = guide.count("\n", 0, first.start()) + 1
            problems.append(f"{word}: used at line {line}, before the glossary defines it")
    return problems


def test_every_glossary_word_is_defined_before_the_guide_uses_it():
    problems = glossary_problems(GUIDE.read_text())
    assert not problems, "docs/pipeline.md:\n" + "\n".join(problems)


def test_a_word_used_early_or_left_undefined_fails_the_glossary_check():
    guide = GUIDE.read_text()
    early = guide.replace("\n## Install\n", "\n## Install\n\nThe watch decides.\n", 1)
    assert any(p.startswith("watch: used at line") for p in glossary_problems(early))
    undefined = guide.replace("**head batch**", "head batch", 1)
    assert "head batch: not defined in the glossary" in glossary_problems(undefined)


# --- the constructors -----------------------------------------------------------------------------

_CONSTRUCTOR = re.compile(r"`(\w+)\((model|pipeline_stages|name)([^`]*)\)`")


def listed_constructors(guide: str) -> dict[str, list[str]]:
    """The guide's constructors in "Switching from torchrec": class name to positional parameters."""
    section = guide[guide.index("\n## Switching from torchrec\n") :].split("\n## ", 2)[1]
    found = {}
    for m in _CONSTRUCTOR.finditer(" ".join(section.split())):
        params = [m.group(2)] + [p.split("=")[0].strip() for p in m.group(3).split(",") if p.strip()]
        found[m.group(1)] = params
    return found


def signature_problems(listed: dict[str, list[str]]) -> list[str]:
    problems = []
    for name, params in listed.items():
        cls = getattr(pipeline, name, None)
        if cls is None:
            problems.append(f"{name}: not exported by pipeline")
            continue
        signature = inspect.signature(cls)
        positional = [p for p, v in signature.parameters.items() if v.kind != v.KEYWORD_ONLY]
        if params != positional:
            problems.append(f"{name}: the guide lists {params}, the class takes {positional}")
    return problems


def test_the_constructor_list_is_each_class_signature():
    listed = listed_constructors(GUIDE.read_text())
    assert {"TrainPipelineBase", "TrainPipelineSparseDist", "PrefetchTrainPipelineSparseDist"} <= set(listed)
    problems = signature_problems(listed)
    assert not problems, "docs/pipeline.md, Switching from torchrec:\n" + "\n".join(problems)


def test_a_parameter_left_out_of_the_list_fails_the_check():
    guide = GUIDE.read_text()
    stale = guide.replace(
        "clear_data_dist_inputs=False,\n  async_inplace_copy=False)`", "clear_data_dist_inputs=False)`", 1
    )
    assert stale != guide
    problems = signature_problems(listed_constructors(stale))
    assert len(problems) == 1 and problems[0].startswith("TrainPipelineSparseDist: the guide lists"), problems
