"""Drivers run inside a namespace host by tests/test_multihost.py (RAY_ADDRESS names the head).

``placement STORE JOB``: pools on every host, one probe cluster per pool; prints where each rank sits.
``ddp STORE MODEL``: two DDP ranks on two hosts (H800 + H20) and one rank on the whole batch.
``kill STORE``: one probe on host c's H20; prints READY, waits for a line on stdin (the test kills the
host meanwhile), calls the probe and prints the error it gets.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import rollart as ra
from rollart.training import columns as C
from rollart.training.placement import start_data_parallel
from rollart.training.torch_strategy import TorchTrainWorker


class Probe(ra.Worker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def where(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


class DdpRank(TorchTrainWorker):
    @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
    def socket_ifname(self) -> str:
        return os.environ.get("GLOO_SOCKET_IFNAME", "")


def placement(store: str, job: str) -> dict:
    rm = ra.ResourceManager(
        {
            "train": {"hardware": "H800", "devices": 2},
            "rollout": [{"hardware": "H800", "devices": 2}, {"hardware": "H20", "devices": 2}],
        },
        store=store,
        job_id=job,
    )
    train = ra.Cluster("train_probe", Probe, rm, pool="train")
    rollout = ra.Cluster("rollout_probe", Probe, rm, pool="rollout")
    out = {
        "train": train.placement(),
        "rollout": rollout.placement(),
        "train_seen": train.where(),
        "rollout_seen": rollout.where(),
        "job": rm.job_id,
    }
    # the job stays registered (ended) for `rollart status` on another host
    train.shutdown()
    rollout.shutdown()
    rm.shutdown()
    return out


def batch_of(n: int) -> ra.Batch:
    g = torch.Generator().manual_seed(0)
    ids, masks, adv = [], [], []
    for i in range(n):
        length = 4 + i % 5
        row = torch.randint(3, 60, (length,), generator=g).tolist()
        ids.append(row)
        masks.append([0, 0] + [1] * (length - 2))
        adv.append([float((-1) ** i)] * length)
    return ra.Batch(
        {
            C.INPUT_IDS: ids,
            C.LOSS_MASK: masks,
            C.ADVANTAGES: adv,
            C.BEHAVIOUR_LOGPROBS: [[0.0] * len(r) for r in ids],
        }
    )


def ddp(store: str, model: str) -> dict:
    cfg = {"model": model, "lr": 1e-2, "loss": "ppo", "max_tokens_per_microbatch": 16}
    # an H800 group (head or b) and an H20 group (c only): the two ranks sit on two different hosts
    rm = ra.ResourceManager(
        {
            "dp": [{"hardware": "H800", "devices": 1}, {"hardware": "H20", "devices": 1}],
            "single": {"hardware": "H800", "devices": 1},
        },
        store=store,
    )
    dp = ra.Cluster("dp", DdpRank, rm, pool="dp", worker_kwargs={"config": cfg})
    one = ra.Cluster("one", DdpRank, rm, pool="single", worker_kwargs={"config": cfg})
    backends = start_data_parallel(dp)
    batch = batch_of(7)
    for _ in range(2):
        metrics = dp.train_step(batch)
        one.train_step(batch)
    out = {
        "backends": backends,
        "rows": metrics["rows"],
        "ips": [p["node_ip"] for p in dp.placement()],
        "ifnames": dp.socket_ifname(),
        "dp_sums": dp.weight_checksum(),
        "one_sum": one.weight_checksum()[0],
    }
    rm.shutdown()
    return out


def kill(store: str) -> dict:
    rm = ra.ResourceManager({"c_pool": {"hardware": "H20", "devices": 1}}, store=store)
    probe = ra.Cluster("probe_c", Probe, rm, pool="c_pool")
    print("READY " + json.dumps({"seen": probe.where(), "placement": probe.placement()}), flush=True)
    sys.stdin.readline()  # the test has killed host c
    try:
        probe.where()
    except ra.WorkerDiedError as err:
        return {
            "error": str(err),
            "type": type(err).__name__,
            "node_ip": err.node_ip,
            "rank": err.rank,
            "cluster": err.cluster,
            "ray_cluster": err.ray_cluster,
        }
    return {"error": None}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    result = {"placement": placement, "ddp": ddp, "kill": kill}[mode](*rest)
    print("RESULT " + json.dumps(result), flush=True)
