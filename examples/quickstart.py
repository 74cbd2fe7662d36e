"""A complete training script under the pipeline: process group, model, sharding, pipeline, loop.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node=2 examples/quickstart.py

docs/pipeline.md, "A complete script", shows this file (tests/test_guide.py checks that the two are
the same and runs it on 2 gloo ranks).
"""

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from pipeline import TrainPipelineSparseDist  # was: from torchrec.distributed.train_pipeline import ...

FEATURES, ROWS, DIM, DENSE, SAMPLES = ["f0", "f1"], 100_000, 8, 4, 16


def batches(n: int, rank: int) -> list[Batch]:
    """`n` batches of random ids, dense features and labels; each rank reads its own."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 4, (len(FEATURES) * SAMPLES,), generator=gen)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=ids, lengths=lengths)
        dense = torch.rand(SAMPLES, DENSE, generator=gen)
        labels = torch.randint(0, 2, (SAMPLES,), generator=gen).float()
        out.append(Batch(dense_features=dense, sparse_features=sparse, labels=labels))
    return out


def main(argv: list[str] | None = None) -> int:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, device = dist.get_rank(), torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
        for f in FEATURES
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[DIM],
        over_arch_layer_sizes=[8, 1],
    )
    model = DLRMTrain(dlrm)  # model(batch) returns (loss, output): what the pipeline trains on
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})  # the tables' optimizer
    model = DistributedModelParallel(model, device=device)  # shards the tables over the ranks
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=0.1))

    pipe = TrainPipelineSparseDist(model, optimizer, device)
    it = iter(batches(20, rank))
    steps = 0
    while True:
        try:
            loss, _logits, _labels = pipe.progress(it)  # one batch trained; the next ones in flight
        except StopIteration:  # every batch trained, on every rank
            break
        steps += 1
    if rank == 0:
        print(f"trained {steps} batches, last loss {loss.item():.4f}")
        print(pipe.rewrite_report)  # which sharded modules are pipelined, and how
        print(pipe.tuner)  # what the default input_dist schedule saw and did
    pipe.close()  # frees what the pipeline made: its threads and process groups
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
