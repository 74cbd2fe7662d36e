"""Sharded checkpoints for the DLRM example (`--checkpoint-dir DIR --checkpoint-every N`): save with
torch.distributed.checkpoint (DCP), every rank writing its own shards, and resume from the newest
complete checkpoint in DIR.

A checkpoint holds the model (embedding shards and dense parameters), the fused embedding
optimizer's and the dense optimizer's states, every rank's RNG state, the step and the data
position (epoch and batch). It is written to `DIR/.step-N.tmp` and renamed to `DIR/step-N` by rank
0 once every rank has written its part, so resume never sees a partial one: a save cut off by a
kill leaves only a temporary directory, which the next save of that step replaces. With tables on
disk (`--embedding-store`), each rank's store files are copied into `step-N/stores/` by streaming
(`tiered.snapshot`). The last two checkpoints are kept.

No drain: the pipelines keep, per batch in flight, the data iterator's state from before the
batch was fetched (`pipe.dataloader_state(it)`), so the data position saved is that of the oldest
batch not yet trained, which is exactly what the model and optimizer have seen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from examples.dlrm.config import InputError, TrainConfig
from examples.dlrm.faults import KillPlan, LossLog

__all__ = ["Checkpoints", "Position", "model_state", "tiered_kernels"]

_COMMITTED = re.compile(r"step-(\d+)")
_KEEP = 2
_PROGRESS_KEYS = ("step", "epoch", "batch", "world_size", "plan", "tiered")


@dataclass(kw_only=True, slots=True)
class Position:
    """Where training stands: steps trained, and the data iterator's position."""

    step: int = 0
    """Steps trained (over all epochs)."""
    epoch: int = 0
    """The epoch of the next batch."""
    batch: int = 0
    """Batches of that epoch already trained."""
    path: str | None = None
    """The checkpoint it was read from (None: a fresh start)."""


def tiered_kernels(model: nn.Module) -> list[Any]:
    """Every tiered (disk-backed) kernel of `model` on this rank."""
    return [k for m in model.modules() if hasattr(m, "tiered_kernels") for k in m.tiered_kernels()]


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, tiered: bool) -> dict[str, Any]:
    """The model's and both optimizers' state for DCP; with `tiered`, without the tables on disk
    and their optimizer state (the store files carry those)."""
    state = model.state_dict()
    if tiered:
        tiered_prefixes = tuple(_tiered_prefixes(model))
        state = {k: v for k, v in state.items() if not k.startswith(tiered_prefixes)}
    fused = {} if tiered else model.fused_optimizer.state_dict()
    return {"model": state, "fused_optimizer": fused, "dense_optimizer": optimizer.state_dict()}


class Checkpoints:
    """Saves and restores one run's checkpoints; every rank must make the same calls.

    Args:
        config: the run (`checkpoint_dir`, `checkpoint_every`, `embedding_store`, `inject_kill`).
        model: the sharded model (DistributedModelParallel).
        optimizer: the dense optimizer (the embeddings' fused one is `model.fused_optimizer`).
        plan: the sharding plan's description, saved and compared at resume.
        log: where kill events are logged (`--loss-log`), or None.
        watch: the pipeline's schedule watch (`pipe.tuner` under the default schedule), or None:
            its decision is saved, and a resumed run takes it (once every rank holds it) instead of
            watching again.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: str,
        log: LossLog | None = None,
        watch: Any = None,
    ) -> None:
        assert config.checkpoint_dir is not None
        self.directory = Path(config.checkpoint_dir)
        self.every = config.checkpoint_every
        self.save_seconds: list[float] = []
        """How long each save stalled training on this rank."""
        self._model, self._optimizer, self._plan = model, optimizer, plan
        self._tiered = config.embedding_store is not None
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._kill = KillPlan.parse(config.inject_kill) if config.inject_kill else None
        self._log = log
        self._watch = watch
        self._saved_at = -1
        self._group = dist.new_group(backend="gloo") if config.checkpoint_async else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: tuple[Any, Path, Path] | None = None

    # -- resume -------------------------------------------------------------------------------

    def resume(self) -> Position:
        """Load the newest complete checkpoint in the directory, if any; where training stands.

        Raises:
            InputError: the checkpoint does not fit this run (other tables or flags), or was saved
                with tables on disk and another world size or sharding.
        """
        found = [str(latest(self.directory)) if self._rank == 0 else None]
        dist.broadcast_object_list(found, src=0)  # rank 0's view decides (a shared directory)
        if found[0] in (None, "None"):
            return Position()
        path = Path(found[0])
        meta = _read_meta(path)
        self._check_fits(path)
        state = self._state(Position(), keys=meta.state_dict_metadata)
        try:
            dcp.load(state, checkpoint_id=path)
            self._model.load_state_dict(state["model"], strict=not self._tiered)
            if not self._tiered:
                self._model.fused_optimizer.load_state_dict(state["fused_optimizer"])
            self._optimizer.load_state_dict(state["dense_optimizer"])
            if self._tiered:
                from tiered.snapshot import load_stores

                load_stores(tiered_kernels(self._model), path / "stores")
        except Exception as e:  # DCP raises on every rank alike (it gathers the ranks' errors)
            raise InputError(
                f"cannot resume from {path}: {_first_line(e)}. It was saved by a run with other "
                "tables or flags: rerun with that run's flags, or point --checkpoint-dir at an "
                "empty directory to start afresh"
            ) from e
        rng = state.get(f"rng/rank{self._rank}")
        if rng is not None:
            torch.set_rng_state(rng)
        saved = json.loads(state["progress"])
        if self._watch is not None:  # absent in older checkpoints; the removed tuner's has no phase
            state = saved.get("tuner", {})
            self._watch.load_state_dict(state if "phase" in state else {})
        return Position(step=saved["step"], epoch=saved["epoch"], batch=saved["batch"], path=str(path))

    def _check_fits(self, path: Path) -> None:
        saved = _progress(path)
        if saved["tiered"] != self._tiered:
            with_store = "with" if saved["tiered"] else "without"
            raise InputError(
                f"{path} was saved {with_store} --embedding-store; resume with the same tables' "
                "kernel, or point --checkpoint-dir at an empty directory"
            )
        if self._tiered and (saved["world_size"], saved["plan"]) != (self._world, self._plan):
            raise InputError(
                f"{path} was saved with tables on disk on {saved['world_size']} rank(s) "
                f"({saved['plan']}); tables on disk resume only onto the same world size and "
                f"sharding, not {self._world} rank(s) ({self._plan})"
            )

    # -- save ---------------------------------------------------------------------------------

    def after_step(self, step: int, runner: Any, train_iter: Any) -> None:
        """Save if `step` is due (every `every` steps), as of the oldest batch `runner` has not
        trained (`dataloader_state`; no drain)."""
        if self._kill is not None:
            self._kill.maybe_kill(rank=self._rank, step=step, in_save=False, log=self._log)
        self.poll()
        if not (self.every and step % self.every == 0):
            return
        data = runner.dataloader_state(train_iter)
        self.save(Position(step=step, epoch=data["epoch"], batch=data["batch"]))

    def save(self, position: Position) -> Path:
        """Write a checkpoint of the current state as of `position` and commit it once every rank
        has written its part (with `checkpoint_async`, the write runs behind training and rank 0
        commits it when it is done); a collective. Does nothing if the step was just saved."""
        if position.step == self._saved_at:
            return _final(self.directory, position.step)
        started = time.perf_counter()
        self.wait()
        tmp, final = self.directory / f".step-{position.step:09d}.tmp", _final(self.directory, position.step)
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was cut off
            self.directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self._tiered:  # the stores first: an async write's commit needs them in place
            from tiered.snapshot import save_stores

            save_stores(tiered_kernels(self._model), tmp / "stores")
        if self._group is not None:
            # A copy (training goes on changing the tensors), written on a thread with its
            # collectives on a group of their own, never interleaved with training's. DCP's
            # async_save would stage it too, but its stager cannot copy ShardedTensors.
            state = _copy(self._state(position))
            future = self._writer.submit(dcp.save, state, checkpoint_id=tmp, process_group=self._group)
            self._pending = (future, tmp, final)
        else:
            dcp.save(self._state(position), checkpoint_id=tmp)
            if self._kill is not None:
                self._kill.maybe_kill(rank=self._rank, step=position.step, in_save=True, log=self._log)
            dist.barrier()  # every rank's part is on disk
            self._commit(tmp, final)
        self._saved_at = position.step
        self.save_seconds.append(time.perf_counter() - started)
        return final

    def poll(self) -> None:
        """Commit an async save that has finished (rank 0), without waiting."""
        if self._pending is not None and self._pending[0].done() and self._rank == 0:
            self.wait()

    def wait(self) -> None:
        """Wait for the async save in flight, if any, and commit it (rank 0)."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        future.result()  # on rank 0, done means every rank's part and the metadata are written
        self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        if self._rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
            _prune(self.directory, keep=_KEEP)

    def _state(self, position: Position, keys: Any = None) -> dict[str, Any]:
        state = model_state(self._model, self._optimizer, tiered=self._tiered)
        values = (position.step, position.epoch, position.batch, self._world, self._plan, self._tiered)
        # One JSON string: DCP flattens a dict of plain values differently when saving and loading.
        progress = dict(zip(_PROGRESS_KEYS, values, strict=True))
        progress["tuner"] = self._watch.state_dict() if self._watch is not None else {}  # as `pipe.tuner`
        state["progress"] = json.dumps(progress)
        rng_key = f"rng/rank{self._rank}"
        if keys is None or rng_key in keys:  # at resume onto more ranks, the new ones have none
            state[rng_key] = torch.get_rng_state()
        return state


def _copy(state: Any) -> Any:
    """A deep copy of a state dict's tensors, ShardedTensors included (their local shards)."""
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in state.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=state.metadata(), process_group=state._process_group
        )
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def latest(directory: Path) -> Path | None:
    """The committed checkpoint of the highest step in `directory`, or None."""
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _COMMITTED.fullmatch(p.name))]
    return max(steps)[1] if steps else None


def _final(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}"


def _prune(directory: Path, *, keep: int) -> None:
    steps = sorted(int(m.group(1)) for p in directory.iterdir() if (m := _COMMITTED.fullmatch(p.name)))
    for step in steps[:-keep]:
        shutil.rmtree(_final(directory, step), ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_meta(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise InputError(
            f"{path} is not a readable checkpoint ({_first_line(e)}); delete it or point "
            "--checkpoint-dir elsewhere"
        ) from e


def _progress(path: Path) -> dict[str, Any]:
    """The `progress` entry of a checkpoint, read on this rank alone."""
    holder: dict[str, Any] = {"progress": ""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(holder, checkpoint_id=path, no_dist=True)
    return json.loads(holder["progress"])


def _tiered_prefixes(model: nn.Module) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = []
    for module in model.modules():
        if hasattr(module, "tiered_kernels"):
            name = names[id(module)].replace("_dmp_wrapped_module.", "").replace("module.", "", 1)
            prefixes.append(f"{name}.embedding_bags.")
    return prefixes


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
