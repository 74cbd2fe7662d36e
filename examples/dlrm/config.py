"""What one DLRM training run is: the `TrainConfig` dataclass, and `InputError` for bad input.

Every check on user input (flags, data files, their contents) raises `InputError` with a message that
names what is wrong and how to fix it; `train.py` turns it into one paragraph and exit status 2.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "PIPELINES",
    "PREFETCH_AHEAD",
    "SCHEDULES",
    "InputError",
    "TrainConfig",
]

PIPELINES = ("none", "base", "sparse-dist", "prefetch")
SCHEDULES = ("adaptive", "late", "early", "early-shared", "late-own")
PREFETCH_AHEAD = ("auto", "true", "false")
NUM_DENSE = 13
NUM_SPARSE = 26


class InputError(Exception):
    """Bad user input: a flag value, a data file that cannot be read, or a malformed line.

    Args:
        message: what is wrong and how to fix it, one paragraph.
        every_rank: every rank raises this same error at the same point (a flag, a column count
            that every rank checks): one rank's message is enough.
    """

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run. Sizes are small by default so that 2 CPU ranks train in seconds."""

    pipeline: str = "sparse-dist"
    """`none` (plain loop), `base`, `sparse-dist` or `prefetch` (classes of the `pipeline` package)."""
    input_dist_schedule: str = "adaptive"
    """With `sparse-dist` or `prefetch`: when the next batch's input all-to-alls run (the pipeline's
    `input_dist_schedule`): `adaptive` (the library's default: torchrec's order, moving to `early`
    where the steps wait for the input all-to-all and that pays), `late` (torchrec's order, pinned),
    `early`, `early-shared` or `late-own`."""
    prefetch_ahead: str = "auto"
    """With `prefetch`: the pipeline's `prefetch_ahead`: `auto` (the library's default: on CPU
    inline until its watch sees that ahead pays), `true` (the prefetch of batch i+1 during backward
    of i, pinned) or `false` (inline, pinned)."""
    batch_size: int = 256
    """Global batch size: every step trains on this many samples, split evenly over the ranks, so it
    must be divisible by the world size."""
    steps: int = 20
    """Batches per epoch. Synthetic data has exactly this many; with `data` it caps each pass over
    the files, and 0 means the whole pass."""
    epochs: int = 1
    """Passes over the training data. Synthetic data repeats the same batches each epoch."""
    embedding_dim: int = 16
    """Width of every embedding table (DLRM needs one width for all)."""
    num_embeddings: tuple[int, ...] = (10_000,)
    """Rows per table: one value for all 26 tables, or 26 values."""
    pooling: int = 1
    """Mean ids per sparse feature per sample in synthetic data (Criteo has 1)."""
    dense_hidden: tuple[int, ...] = (64,)
    """Hidden widths of the bottom MLP; `embedding_dim` is appended as its output."""
    over_hidden: tuple[int, ...] = (64,)
    """Hidden widths of the top MLP; a single logit is appended as its output."""
    lr: float = 0.05
    """Learning rate of both Adagrad optimizers (embeddings row-wise, fused into backward; dense)."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic data."""
    data: str | None = None
    """Criteo TSV file or glob for training; None trains on synthetic data."""
    eval_data: str | None = None
    """Criteo TSV file or glob for eval; None evaluates on a synthetic stream (only without `data`)."""
    eval_every: int = 0
    """Run an eval pass every this many training steps and after the last one; 0 disables eval."""
    eval_batches: int = 8
    """Batches per eval pass."""
    log_every: int = 10
    """Steps between loss/AUC/throughput reports."""
    warmup_steps: int = 2
    """Steps left out of the throughput figures, after which profiling starts."""
    profile_dir: str | None = None
    """Write a chrome trace per rank, `rank{r}.json`, here; None disables profiling."""
    profile_steps: int = 3
    """Steps recorded by the profiler."""
    sharding_types: tuple[str, ...] | None = None
    """Sharding types the planner may use; None: table_wise and column_wise on CPU (torchrec has no
    row-wise sharding over gloo), and those plus the row-wise kinds on GPU."""
    show_progress: bool = True
    """Show the tqdm bar and the periodic reports on rank 0."""
    embedding_store: str | None = None
    """Put every table on the disk-backed `tiered` kernel, its files in this existing directory;
    None keeps the tables in RAM (torchrec's fused kernel)."""
    cache_rows: int | None = None
    """RAM rows cached per table shard with `embedding_store`: at least the distinct rows of the
    batches in flight (`examples.dlrm.store.cache_rows_needed`, checked before the first step)."""
    cold_store: bool = False
    """With `embedding_store`: drop rows from the OS page cache after reading them, so every cache
    miss reads the disk (what a table larger than RAM does; for benchmarks and the timeline)."""
    store_mode: str = "create"
    """With `embedding_store`: `create` writes new stores from the initial weights (replacing
    same-shaped ones), `open` trains on the rows of existing ones (which must match the tables)."""

    checkpoint_dir: str | None = None
    """Save sharded checkpoints here (torch.distributed.checkpoint), and resume from the newest
    complete one at start; None: no checkpoints."""
    checkpoint_every: int = 0
    """With `checkpoint_dir`: save every this many steps and after the last one (0: after the last
    one only)."""
    checkpoint_async: bool = False
    """With `checkpoint_dir`: write checkpoints behind training (DCP's `async_save`: the state is
    copied, then written on a thread); each is committed once written."""
    inject_kill: str | None = None
    """`RANK:step:N` or `RANK:save:N`: SIGKILL that rank after step N, or while it saves the
    checkpoint of step N, in the first attempt of a torchrun job only (demos and tests)."""
    loss_log: str | None = None
    """Append every step's loss on every rank here, exactly (`examples.dlrm.faults.LossLog`)."""

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise InputError(f"unknown pipeline {self.pipeline!r}; choose one of {PIPELINES}")
        if self.input_dist_schedule not in SCHEDULES:
            raise InputError(
                f"unknown --input-dist-schedule {self.input_dist_schedule!r}; choose one of {SCHEDULES}"
            )
        if self.prefetch_ahead not in PREFETCH_AHEAD:
            raise InputError(
                f"unknown --prefetch-ahead {self.prefetch_ahead!r}; choose one of {PREFETCH_AHEAD}"
            )
        _positive(batch_size=self.batch_size, epochs=self.epochs, embedding_dim=self.embedding_dim)
        _positive(pooling=self.pooling, eval_batches=self.eval_batches, log_every=self.log_every)
        _positive(profile_steps=self.profile_steps)
        if self.steps < 0 or (self.steps == 0 and self.data is None):
            raise InputError(
                f"--steps must be positive (0, a whole pass, only with --data), got {self.steps}"
            )
        if self.eval_every < 0 or self.warmup_steps < 0:
            raise InputError("--eval-every and --warmup-steps must not be negative")
        if len(self.num_embeddings) not in (1, NUM_SPARSE):
            raise InputError(
                f"--num-embeddings takes one size or {NUM_SPARSE} comma-separated sizes, "
                f"got {len(self.num_embeddings)}"
            )
        if min(self.num_embeddings) < 1 or max(self.num_embeddings) >= 2**31:
            raise InputError(
                f"table sizes must be in [1, 2**31), got {min(self.num_embeddings)}"
                f"..{max(self.num_embeddings)}"
            )
        if (self.embedding_store is None) != (self.cache_rows is None):
            raise InputError("--embedding-store DIR and --cache-rows N go together; give both or neither")
        if self.cache_rows is not None:
            _positive(cache_rows=self.cache_rows)
        if self.store_mode not in ("create", "open"):
            raise InputError(f"--store-mode must be create or open, got {self.store_mode!r}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and self.checkpoint_dir is None):
            raise InputError("--checkpoint-every N needs --checkpoint-dir DIR and N >= 0")
        if self.checkpoint_async and self.checkpoint_dir is None:
            raise InputError("--checkpoint-async needs --checkpoint-dir DIR")
        if self.inject_kill is not None:
            from examples.dlrm.faults import KillPlan

            kill = KillPlan.parse(self.inject_kill)
            if kill.during_save and self.checkpoint_dir is None:
                raise InputError("--inject-kill RANK:save:N needs --checkpoint-dir")
        if self.eval_every and self.data is not None and self.eval_data is None:
            raise InputError("--eval-every with --data needs --eval-data (a held-out TSV)")

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """Rows of each of the 26 tables."""
        if len(self.num_embeddings) == 1:
            return self.num_embeddings * NUM_SPARSE
        return self.num_embeddings

    def local_batch_size(self, world_size: int) -> int:
        """Samples per rank per step.

        Raises:
            InputError: the global batch size does not divide by `world_size`.
        """
        if self.batch_size % world_size:
            raise InputError(
                f"--batch-size is the global batch size and must be divisible by the world size: "
                f"{self.batch_size} samples do not split evenly over {world_size} ranks; "
                f"use a multiple of {world_size}"
            )
        return self.batch_size // world_size


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} must be a positive integer, got {value}")
