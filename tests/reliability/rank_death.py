"""A training job in which one rank dies (``os._exit``) at a chosen point; the survivors report.

Run by ``test_rank_death.py`` as processes of their own, forked like the pool's workers (not the
worker pool, which would stop the survivors as soon as one worker dies, and not torchrun, which
does the same); ``python rank_death.py RANK WORLD PORT WHERE TIMEOUT_S OUT`` runs one by hand.
Each process joins a gloo group with a short timeout, builds the tiny decoder with dmuon on FSDP2,
and trains. The dying rank exits at ``where`` ("forward": inside layer 1's forward;
"after-backward": between backward and step). Every survivor writes what it raised, and after how
long, as JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(
    rank: int, world: int, port: int, where: str, timeout_s: float, out: str, log: str | None = None
) -> None:
    if log is not None:  # file descriptors 1 and 2, so gloo's own messages land there too
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    from tests.distributed.models import batches, loss_fn, rank_rows
    from tests.distributed.scenarios_protocol import TrainConfig, build

    model, optimizer, _ = build(TrainConfig())
    dying = rank == world - 1
    if dying and where == "forward":
        model.layers[1].register_forward_pre_hook(lambda module, args: os._exit(1))
    started = time.monotonic()
    try:
        for batch in batches(4, world):
            loss_fn(model, rank_rows(batch, rank, world)).backward()
            if dying and where == "after-backward":
                os._exit(1)
            optimizer.step()
            optimizer.zero_grad()
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    Path(out).write_text(json.dumps({"error": error, "seconds": time.monotonic() - started}))
    os._exit(0)  # no teardown: the group has a dead member


if __name__ == "__main__":
    rank, world, port, where, timeout_s, out = sys.argv[1:]
    main(int(rank), int(world), int(port), where, float(timeout_s), out)
