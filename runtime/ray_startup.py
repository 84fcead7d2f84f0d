"""Starting the Ray the backend runs on, or joining a running one.

:func:`start_local_ray` starts a new single-node cluster on this machine whose every server listens on
loopback only (node IP 127.0.0.1, no dashboard), with Ray's token authentication as Ray sets it for a new
local cluster, and retries a start that timed out; :func:`connect_ray` joins a running cluster at an address
(see ``docs/ray.md``).
"""
from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import time
from collections.abc import Callable
from typing import Any


LOOPBACK = "127.0.0.1"
GCS_PORT_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
"""Ray's limit (seconds, default 30) on waiting for the GCS server to bind its port."""


def local_ray_options(num_cpus: int) -> dict[str, Any]:
    """The ``ray.init`` arguments of the local Ray the backend starts: always a new cluster (``"local"``, never
    one ``ray start`` left on the machine), node IP loopback, no dashboard, worker logs kept off the driver."""
    return dict(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus,
                log_to_driver=False)


@contextlib.contextmanager
def loopback_node_ip():
    """Lets ``ray.init(_node_ip_address="127.0.0.1")`` keep loopback as the node IP.

    On Linux Ray swaps a loopback node IP for the machine's address (``services.resolve_ip_for_localhost``)
    unless its multi-node mode is off, a flag it reads once at import (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    into ``ray_constants.ENABLE_RAY_CLUSTER``). Given 127.0.0.1, the GCS, raylet, object manager, worker and
    agent servers all bind loopback. Later lookups read the started node, so the flag is put back after.
    """
    from ray._private import ray_constants
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _gcs_port_wait(seconds: float):
    """Ray's GCS port wait raised to ``seconds`` for the duration of a start, unless the user set it."""
    if GCS_PORT_WAIT_VARIABLE in os.environ:
        yield
        return
    os.environ[GCS_PORT_WAIT_VARIABLE] = str(max(1, math.ceil(seconds)))
    try:
        yield
    finally:
        os.environ.pop(GCS_PORT_WAIT_VARIABLE, None)


def is_startup_timeout(error: BaseException) -> bool:
    """Whether ``ray.init`` failed because a piece of Ray did not come up in time (Ray raises a bare
    ``Exception("The current node timed out during startup...")`` when its raylet does not register within a
    fixed 30 s)."""
    return isinstance(error, TimeoutError) or "timed out" in str(error).lower()


def _stop_half_started_node(error: BaseException) -> None:
    """Stops the processes of the Ray node whose start raised ``error``: ``ray.init`` leaves them running (the
    node never became the global node that ``ray.shutdown`` stops). The node is the ``self`` of a frame of
    ``Node.__init__`` in the traceback; nothing happens when there is none."""
    from ray._private.node import Node
    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, wait=True)
            return
        tb = tb.tb_next


def start_local_ray(*, num_cpus: int, startup_timeout: float, init: Callable[..., Any] | None = None,
                    clock: Callable[[], float] = time.monotonic):
    """Starts the backend's local Ray (:func:`local_ray_options`) and returns ``init``'s context.

    A start that times out (:func:`is_startup_timeout`; Ray's raylet wait is a fixed 30 s that a loaded
    machine can exceed) has its half-started processes stopped and is tried again while ``startup_timeout``
    seconds have not passed since the first try; Ray's GCS port wait is given what is left of them.

    Args:
      num_cpus: the CPUs the node offers to tasks and actors.
      startup_timeout: seconds all tries together may take before the start fails.
      init: ``ray.init`` (a stand-in in tests); ``clock``: seconds, monotonic.

    Raises:
      RuntimeError: every try timed out and ``startup_timeout`` is spent (the message says how to allow
        longer), or the started node's IP is not loopback (Ray is then shut down).
    """
    import ray
    init = init or ray.init
    start, tries = clock(), 0
    while True:
        tries += 1
        try:
            with loopback_node_ip(), _gcs_port_wait(startup_timeout - (clock() - start)):
                context = init(**local_ray_options(num_cpus))
            break
        except Exception as e:  # noqa: BLE001  (Ray raises a bare Exception on a startup timeout)
            if not is_startup_timeout(e):
                raise
            _stop_half_started_node(e)
            elapsed = clock() - start
            if elapsed >= startup_timeout:
                raise RuntimeError(
                    f"Ray backend: the local Ray's startup timed out ({tries} tries in {elapsed:.0f} s, "
                    f"startup_timeout={startup_timeout:g} s; Ray said: {e}). The machine may be loaded: allow "
                    "longer with al.init(cluster='ray', startup_timeout=...), or start Ray yourself "
                    "(ray.init(...)) before al.init") from e
    node_ip = context.address_info["node_ip_address"]
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray backend: the local Ray started with node IP {node_ip}, not {LOOPBACK}, so its "
                           "servers would listen beyond this machine; it was shut down. Start Ray yourself "
                           "(ray.init(...)) before al.init to choose its addresses")
    return context


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``"host:port"``) names this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_ray(address: str, init: Callable[..., Any] | None = None) -> None:
    """Connects this process to the running Ray cluster at ``address`` (``"host:port"`` or ``"auto"``) as a
    driver, without a dashboard or worker logs. A loopback address (a cluster started with
    ``--node-ip-address=127.0.0.1``, as :class:`~alpa_like.runtime.ray_local_cluster.LocalCluster` does) is
    dialled on loopback with the driver's node IP loopback too: Ray would otherwise swap 127.0.0.1 for the
    machine's address, where such a cluster does not listen. ``init``: ``ray.init`` (a stand-in in tests)."""
    import ray
    init = init or ray.init
    if not is_loopback_address(address):
        init(address=address, include_dashboard=False, log_to_driver=False)
        return
    with loopback_node_ip():
        init(address=address, include_dashboard=False, log_to_driver=False, _node_ip_address=LOOPBACK)
