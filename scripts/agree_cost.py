#!/usr/bin/env python
"""What the per-step agreement of all ranks costs (docs/BENCHMARKS.md, "The per-step agreement").

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/agree_cost.py

Each rank calls `distributed.agree` with three flags, as the training loop does at every step boundary,
on the same process group a CPU run uses (gloo); rank 0 prints one JSON line.
"""

import json
import statistics
import time

import torch.distributed as dist

from imagenet_elastic.launch import distributed

WARMUP, CALLS, ROUNDS = 200, 2000, 5

if __name__ == "__main__":
    dist.init_process_group("gloo")
    for _ in range(WARMUP):
        distributed.agree([False, False, False])
    rounds = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            distributed.agree([False, False, False])
        rounds.append((time.perf_counter() - start) / CALLS * 1e6)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": dist.get_world_size(), "median_us": round(statistics.median(rounds), 1),
                          "rounds_us": [round(r, 1) for r in rounds]}))
    dist.destroy_process_group()
