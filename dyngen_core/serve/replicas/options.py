"""How ``dyngen serve --replicas N`` runs: `ReplicaOptions`, and the command-line arguments
that fill it. Imports no Ray, so ``dyngen serve --help`` works without the extra."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Literal

# The routing policies `ReplicaOptions.router` names.
ROUTERS = ("page-hash", "round-robin")
# The environment variable Ray reads for the cluster address.
RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Default of `ReplicaOptions.imbalance_threshold`.
DEFAULT_IMBALANCE_THRESHOLD = 8


@dataclass(frozen=True)
class ReplicaOptions:
    """How many engine replicas run, where, and how requests are routed among them.

    replicas: engine replicas (one engine each; one per GPU on GPU nodes).
    router: "page-hash" (`PageHashRouter`: to the replica holding the longest run of the
        prompt's page hashes, the least-loaded one when queues are imbalanced) or
        "round-robin" (`RoundRobinRouter`: each replica in turn, a baseline).
    imbalance_threshold: page-hash routing falls back to the least-loaded replica when the
        longest and the shortest replica queue (ongoing requests) differ by more than this.
    cpus_per_replica: CPUs Ray reserves for each replica (its torch threads on CPU).
    gpus_per_replica: GPUs Ray reserves for each replica; None: the engine's tensor_parallel
        (1 by default) when the cluster has GPUs, else 0.
    ray_address: the Ray cluster to join ("auto", "ray://host:10001", "host:6379"); None:
        $RAY_ADDRESS when set, else a new local Ray instance.
    max_ongoing_requests: the most requests Ray Serve sends one replica at once (the rest wait
        in the router); the engine batches those it holds.
    """

    replicas: int
    router: Literal["page-hash", "round-robin"] = "page-hash"
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD
    cpus_per_replica: float = 1.0
    gpus_per_replica: float | None = None
    ray_address: str | None = None
    max_ongoing_requests: int = 64

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1; got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}; got {self.router!r}")
        if self.imbalance_threshold < 0:
            raise ValueError("imbalance_threshold must be >= 0; got "
                             f"{self.imbalance_threshold}")
        if self.cpus_per_replica < 0 or (self.gpus_per_replica or 0) < 0:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1; got "
                             f"{self.max_ongoing_requests}")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """``dyngen serve``'s replica arguments (without --replicas, it serves in-process)."""
    group = parser.add_argument_group("replicas on Ray Serve (the replicas extra)")
    group.add_argument("--replicas", type=int, default=0,
                       help="run N engine replicas on Ray Serve behind one endpoint "
                       "(default 0: one engine in this process, no Ray)")
    group.add_argument("--router", choices=ROUTERS, default="page-hash",
                       help="how requests pick a replica (default: page-hash)")
    group.add_argument("--imbalance-threshold", type=int, default=DEFAULT_IMBALANCE_THRESHOLD,
                       help="page-hash routing goes to the least-loaded replica when replica "
                       "queues differ by more than this many requests (default "
                       f"{DEFAULT_IMBALANCE_THRESHOLD})")
    group.add_argument("--cpus-per-replica", type=float, default=1.0)
    group.add_argument("--gpus-per-replica", type=float, default=None,
                       help="default: --tensor-parallel (1) when the Ray cluster has GPUs, "
                       "else 0")
    group.add_argument("--ray-address", default=None,
                       help=f"Ray cluster to join (default: ${RAY_ADDRESS_ENV} when set, else "
                       "a new local Ray instance)")


def replica_options(args: argparse.Namespace) -> ReplicaOptions:
    """`ReplicaOptions` from parsed ``dyngen serve`` arguments (``--replicas`` >= 1)."""
    return ReplicaOptions(
        replicas=args.replicas, router=args.router,
        imbalance_threshold=args.imbalance_threshold,
        cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
        ray_address=args.ray_address or os.environ.get(RAY_ADDRESS_ENV) or None,
        max_ongoing_requests=max(1, args.max_batch_size),
    )
