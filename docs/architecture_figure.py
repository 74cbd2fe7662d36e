"""Draws docs/img/architecture.png: the modules of pipeline/ and rewrite/, and how a batch flows
through them. Run: `python docs/architecture_figure.py` (matplotlib only; no torch)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

BOXES = {
    # name: (x, y, w, h, colour, lines of text)
    "classes": (
        0.3,
        7.6,
        13.4,
        1.6,
        "#dbe9f6",
        (
            "pipelines/: the classes a user constructs; SparseDist's one step, overridden by hooks",
            "sparse_dist.py (SparseDist, Lite, Eval)  lookups.py (Fused, EvalFused, PEC, SemiSync)",
            "prefetch.py  in_backward.py  experimental.py  staged.py  pt2.py  base.py ...",
        ),
    ),
    "compat": (
        0.3,
        5.7,
        3.6,
        1.4,
        "#f6e7db",
        (
            "compat/: only for torchrec",
            "__init__.py (its types)",
            "backward_injection.py data_loading.py",
        ),
    ),
    "core": (
        4.3,
        5.7,
        4.6,
        1.4,
        "#dbe9f6",
        (
            "pipelines/core.py  PipelineCore:",
            "lanes, progress / drain / reset / close;",
            "copy, forward, backward, optimizer",
        ),
    ),
    "options": (
        9.3,
        5.7,
        4.4,
        1.4,
        "#f2f2f2",
        (
            "options.py: RankOptions,",
            "RewriteOptions, InputDistOptions,",
            "PrefetchOptions (the one way in)",
        ),
    ),
    "ranks": (
        0.3,
        2.9,
        4.6,
        2.3,
        "#e3f2da",
        (
            "ranks/: the agreement on each batch",
            "protocol.py  Ranks, Lane, Ticket, Votes",
            "riding.py  the status row; Admission",
            "failure.py  a rank that fails",
            "kjt_check.py  keys, well-formed KJTs",
        ),
    ),
    "input_dist": (
        5.3,
        2.9,
        4.0,
        2.3,
        "#dbe9f6",
        (
            "stages/input_dist.py  InputDist",
            "fill / start_next / wait_splits",
            "schedule.py  ScheduleWatch, groups",
            "watch.py  the rule of the watches",
            "narrow.py  int32 ids on the wire",
        ),
    ),
    "stages": (
        9.7,
        2.9,
        4.0,
        2.3,
        "#dbe9f6",
        (
            "stages/prefetch.py  PrefetchStage,",
            "PrefetchWatch (ahead or inline)",
            "lookup.py  LookupStage",
            "stash.py  Stash, EmbeddingStash",
            "context.py  per-batch contexts",
        ),
    ),
    "streams": (
        0.3,
        0.3,
        6.6,
        2.0,
        "#f2f2f2",
        (
            "stages/streams.py  Streams: every hand-off (handoff, consumed,",
            "produced) and the stages' labels: run_stage, pipeline::<stage>#<batch>",
            "CudaStreams, ThreadStreams, KeepAlive",
            "tests/streamcheck/  RecordingStreams (proves hand-offs on CPU)",
        ),
    ),
    "rewrite": (
        7.3,
        0.3,
        6.4,
        2.0,
        "#fbe3e3",
        (
            "rewrite/  (imports nothing of pipeline/)",
            "rewrite_model -> Rewrite; each ArgInfo found",
            "explicit, traced, direct or recorded (find.py)",
            "forwards.py: hijacked forwards, ContextSlot",
            "replay.py: per-batch inputs, fused splits",
        ),
    ),
}

ARROWS = [
    # (from, to, label): points on the boxes' edges
    ((2.1, 7.6), (2.1, 7.15), "torchrec's types"),
    ((6.6, 7.6), (6.6, 7.15), "PipelineCore's stages"),
    ((11.5, 7.6), (11.5, 7.15), "options objects"),
    ((5.2, 5.7), (4.0, 5.25), "fetch, admit, fail"),
    ((7.4, 5.7), (7.4, 5.25), "InputDist"),
    ((8.9, 5.9), (10.6, 5.25), "prefetch, lookup, stash"),
    ((5.3, 4.05), (4.9, 4.05), ""),
    ((9.3, 4.05), (9.7, 4.05), ""),
    ((8.4, 2.9), (8.9, 2.35), "attach, detach"),
    ((11.7, 2.9), (11.7, 2.35), "contexts feed forwards"),
    ((6.0, 2.9), (6.0, 2.35), "hand-offs"),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(14, 9.6))
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 9.4)
    ax.axis("off")
    for x, y, w, h, colour, text_lines in BOXES.values():
        text = "\n".join(text_lines)
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#555"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5, family="monospace")
    for (x0, y0), (x1, y1), label in ARROWS:
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, color="#345"))
        if label:
            ax.text(
                (x0 + x1) / 2,
                (y0 + y1) / 2,
                label,
                fontsize=8,
                color="#234",
                ha="center",
                bbox={"fc": "white", "ec": "none", "alpha": 0.8},
            )
    ax.set_title(
        "torchrec-pipeline: modules and the path of one batch "
        "(dataloader -> Ranks.fetch -> copy -> InputDist -> context -> hijacked forward)",
        fontsize=10,
    )
    out = Path(__file__).parent / "img" / "architecture.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
