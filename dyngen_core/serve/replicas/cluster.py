"""Running the replicas: join (or start) a Ray cluster, start Serve's HTTP proxy on the
server's host and port, deploy `build_replicas_app`, and serve until interrupted."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import ray
from ray import serve

from dyngen_core.serve.options import ServeOptions
from dyngen_core.serve.replicas.deployment import build_replicas_app
from dyngen_core.serve.replicas.options import ReplicaOptions

logger = logging.getLogger(__name__)
APP_NAME = "dyngen"


def gpus_per_replica(options: ReplicaOptions, tensor_parallel: int = 1) -> float:
    """The GPUs each replica reserves: the option when given, else ``tensor_parallel`` (one
    per rank of the replica's engine) when the connected Ray cluster has GPUs, else 0."""
    if options.gpus_per_replica is not None:
        return options.gpus_per_replica
    return float(tensor_parallel) if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def deploy(serve_options: ServeOptions, replica_options: ReplicaOptions) -> None:
    """Deploy the replicas on the connected Ray cluster (``ray.init`` was called), with Serve's
    proxy listening on the server's host and port; returns once every replica is up."""
    serve.start(http_options={"host": serve_options.host, "port": serve_options.port})
    gpus = gpus_per_replica(replica_options, serve_options.engine_options.tensor_parallel)
    app = build_replicas_app(serve_options, replica_options, gpus)
    serve.run(app, name=APP_NAME, route_prefix="/")


def run_replicas(serve_options: ServeOptions, replica_options: ReplicaOptions) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), then remove the application (and shut Ray
    down when this process started it)."""
    ray.init(address=replica_options.ray_address, log_to_driver=True)
    # After ray.init, which puts in its own SIGTERM handler (it ends the driver within seconds,
    # cutting the clean-up below short and leaving Ray's agents running).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        deploy(serve_options, replica_options)
        logger.warning("dyngen: %d replica(s) of %s serving on http://%s:%d",
                       replica_options.replicas, serve_options.model_name,
                       serve_options.host, serve_options.port)
        while True:
            time.sleep(3600)
    finally:
        serve.delete(APP_NAME)
        if replica_options.ray_address is None:
            serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
