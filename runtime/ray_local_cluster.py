"""A Ray cluster of several nodes on this machine, for tests and benchmarks of the Ray backend across nodes.

Each node is a real Ray node (``ray.cluster_utils.Cluster``): its own raylet, object store and worker
processes; nodes talk over the network stack (loopback here), so a tensor that crosses nodes is copied from
one object store to the other, as between machines.

    with LocalCluster(num_nodes=2, num_cpus_per_node=2) as cluster:
        al.init(cluster="ray", address=cluster.address)   # 2 nodes x 2 CPU devices
        ...
        cluster.remove_node(cluster.nodes[1])             # its raylet and workers killed: a lost node

Like the backend's own local Ray (:func:`~alpa_like.runtime.ray_startup.start_local_ray`), every node listens
on 127.0.0.1 only, runs no dashboard and uses Ray's token authentication unless ``RAY_AUTH_MODE`` says
otherwise. :meth:`LocalCluster.shutdown` (or leaving the ``with`` block) disconnects this process and stops
every node's processes.
"""
from __future__ import annotations

from typing import Any

from alpa_like.compiler.optional_imports import require
from alpa_like.runtime.ray_startup import LOOPBACK, loopback_node_ip

OBJECT_STORE_BYTES = 256 * 1024 * 1024
"""Each node's object store (Ray's test clusters default to 150 MiB)."""


def _enable_token_auth() -> None:
    """Token authentication for the nodes this process starts, as ``ray.init`` sets it up for a new local
    cluster (a token in ``~/.ray/auth_token`` is made if none exists); ``RAY_AUTH_MODE`` set by the user
    wins."""
    from ray._private.authentication.authentication_token_setup import (enable_token_auth_by_default,
                                                                         ensure_token_if_auth_enabled)
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


class LocalCluster:
    """``num_nodes`` Ray nodes on this machine (the first is the head), each offering ``num_cpus_per_node``
    CPUs: as many XLA CPU devices to the Ray backend (:mod:`~alpa_like.runtime.ray_nodes`).

    Args:
      num_nodes: nodes to start (>= 1).
      num_cpus_per_node: each node's ``CPU`` resource (logical: the backend's actors ask for none).
      object_store_memory: bytes of each node's object store.
    """

    def __init__(self, num_nodes: int = 2, num_cpus_per_node: int = 2,
                 object_store_memory: int = OBJECT_STORE_BYTES):
        for name, value in (("num_nodes", num_nodes), ("num_cpus_per_node", num_cpus_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LocalCluster: {name} must be an int >= 1, got {value!r}")
        cluster_utils = require("ray.cluster_utils", "LocalCluster", package="ray")
        self.num_cpus_per_node = num_cpus_per_node
        self.object_store_memory = object_store_memory
        _enable_token_auth()
        with loopback_node_ip():
            self._cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=self._node_args())
        try:
            for _ in range(num_nodes - 1):
                self.add_node()
        except BaseException:
            self._cluster.shutdown()
            raise

    def _node_args(self) -> dict[str, Any]:
        return dict(num_cpus=self.num_cpus_per_node, node_ip_address=LOOPBACK, include_dashboard=False,
                    object_store_memory=self.object_store_memory)

    @property
    def address(self) -> str:
        """The head's GCS address (``127.0.0.1:<port>``): ``al.init(cluster="ray", address=...)``."""
        return self._cluster.address

    @property
    def nodes(self) -> list[Any]:
        """The running nodes (Ray's ``Node`` objects, ``.node_id`` in hex), head first."""
        return self._cluster.list_all_nodes()

    def add_node(self) -> Any:
        """Starts one more node like the others; returns it once it has joined."""
        with loopback_node_ip():
            return self._cluster.add_node(**self._node_args())

    def node(self, node_id: str) -> Any:
        """The running node whose Ray node id is ``node_id``."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise ValueError(f"LocalCluster: no running node has id {node_id!r}")

    def remove_node(self, node: Any) -> None:
        """Kills ``node``'s processes (its raylet, object store and workers) at once, as a machine that is lost;
        the head cannot be removed while this process is connected to it."""
        self._cluster.remove_node(node, allow_graceful=False)

    def processes_alive(self) -> bool:
        """Whether any process of any node this cluster started is still running."""
        return any(node.any_processes_alive() for node in self._cluster.list_all_nodes())

    def shutdown(self) -> None:
        """Disconnects this process from Ray and stops every node."""
        import ray
        ray.shutdown()
        self._cluster.shutdown()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
