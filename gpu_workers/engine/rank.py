"""One non-zero rank of a tensor/pipeline-parallel worker group, as its own process:
`python -m plurai.gpu_workers.engine.rank --config JSON --rank R --size N --port P`. Rank 0's
`parallel.Group` starts these; each joins the group, builds its shard of the model, and
runs every step rank 0 broadcasts until rank 0 sends the stop.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.model_runner import ModelRunner
from plurai.gpu_workers.engine.parallel import init_process_group, recv_step


def main() -> None:
    ap = argparse.ArgumentParser(description="one non-zero rank of a tensor-parallel engine")
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    config = EngineConfig(**json.loads(a.config))
    init_process_group(a.rank, a.size, a.port, config.device)
    runner = ModelRunner(config, a.rank)
    while (seqs := recv_step()) is not None:
        runner.run(seqs)  # type: ignore[arg-type]
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
