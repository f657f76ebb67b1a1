"""`weight_sync.py --replicas 1 2 4`: seconds per sync and bytes per receiver as the receivers grow, on one node and
across (simulated) nodes.

A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): the head node runs the sender (this
process), one worker node per receiver. Receivers are `SinkReceiver` actors that take an update the way a replica does
(`resolve_buckets`: shm stream or object-store refs, one bucket at a time) and copy every tensor into a kept staging
buffer (the engine's staged update without the model), so the numbers are the transport's.

- "one node": every receiver on the head node, `transport="auto"` picks /dev/shm for all of them;
- "nodes": receiver k on worker node k, `auto` picks the Ray object store (one `put` per bucket, shared by all).
  The nodes share this machine's memory, so a cross-node fetch here is a local copy between two object stores, not a
  network transfer: it measures Ray's per-receiver work, not a NIC.

Payloads (synthetic fp32 tensors): the tiny SD3 transformer (full), an SD3.5-Medium-shaped rank-64 LoRA (24 joint
blocks, hidden 1536; A and B of to_q, to_k, to_v, to_out.0, add_q_proj, add_k_proj, add_v_proj, to_add_out) and a
full state of `--full-gb` GB (1 GB by default, 1536 x 1536 tensors).
"""

from __future__ import annotations

import statistics
import time

import torch


class SinkReceiver:
    """A weight-sync target that receives like a replica and keeps one staging buffer per tensor name."""

    def __init__(self):
        self.version = 0
        self.staging: dict[str, torch.Tensor] = {}

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False, *, manifest, buckets,
                                version):
        from omniroll.weights import resolve_buckets, unpack_bucket
        from omniroll.weights.transport import transport_of

        kind = transport_of(buckets, use_shm)
        t0 = time.perf_counter()
        nbytes = 0
        it = resolve_buckets(buckets, use_shm)
        try:
            for b in it:
                for name, t in unpack_bucket(b):
                    dst = self.staging.get(name)
                    if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                        dst = self.staging[name] = torch.empty_like(t)
                    dst.copy_(t)
                    nbytes += t.numel() * t.element_size()
        finally:
            it.close()
        self.version = version
        return {"version": version, "num_bytes": nbytes, "seconds": time.perf_counter() - t0, "transport": kind,
                "node_id": self.node_id()}


def payloads(full_gb: float, tiny_model_path: str) -> dict[str, dict[str, torch.Tensor]]:
    from omniroll.models import load_adapter

    g = torch.Generator().manual_seed(0)
    tiny = {k: v.detach().clone() for k, v in load_adapter(tiny_model_path).denoiser.state_dict().items()}
    lora = {}
    for layer in range(24):
        for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
            base = f"transformer_blocks.{layer}.attn.{m}"
            lora[f"{base}.lora_A.weight"] = torch.randn(64, 1536, generator=g) * 0.01
            lora[f"{base}.lora_B.weight"] = torch.randn(1536, 64, generator=g) * 0.01
    n = max(1, int(full_gb * 2**30 // (1536 * 1536 * 4)))
    full = {f"blocks.{i}.weight": torch.randn(1536, 1536, generator=g) for i in range(n)}
    return {"tiny_full": tiny, "sd35m_lora_r64": lora, f"full_{full_gb:g}gb": full}


def run(replica_counts: list[int], full_gb: float, repeats: int, bucket_mb: float, tiny_model_path: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from omniroll.weights import WeightSender

    most = max(replica_counts)
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "resources": {"head": 1000}})
    for k in range(most):
        cluster.add_node(num_cpus=1, resources={f"n{k}": 1000})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    sink = ray.remote(SinkReceiver)
    results: dict = {}
    try:
        loads = payloads(full_gb, tiny_model_path)
        for name, weights in loads.items():
            payload = sum(t.numel() * t.element_size() for t in weights.values())
            for where in ("one_node", "nodes"):
                for r in replica_counts:
                    targets = [sink.options(num_cpus=0, resources={"head" if where == "one_node" else f"n{k}": 1})
                               .remote() for k in range(r)]
                    sender = WeightSender(targets, bucket_bytes=int(bucket_mb * 2**20), reuse_shm=True)
                    version = 0
                    times = []
                    for rep in range(repeats + 1):  # the first one warms up (actor start, first pages)
                        version += 1
                        t0 = time.perf_counter()
                        acks = sender.send(weights, version=version)
                        if rep:
                            times.append(time.perf_counter() - t0)
                    sender.close()
                    for t in targets:
                        ray.kill(t)
                    s = statistics.median(times)
                    row = {"seconds_per_sync": round(s, 4), "payload_mb": round(payload / 2**20, 2),
                           "bytes_per_receiver": acks[0]["num_bytes"],
                           "transports": sorted({a["transport"] for a in acks}),
                           "nodes": len({a["node_id"] for a in acks}),
                           "per_receiver_s": round(s / r, 4)}
                    results[f"{name}/{where}/{r}"] = row
                    print(f"{name:16s} {where:8s} replicas {r:2d}: {s:8.4f} s/sync  {row['per_receiver_s']:8.4f} s "
                          f"per receiver  {payload / 2**20:8.1f} MB per receiver  {row['transports']}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return results
