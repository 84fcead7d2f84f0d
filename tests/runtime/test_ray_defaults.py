"""The local Ray the backend starts: loopback only, token authentication, its temp dir removed, a start that
timed out tried again.

The loopback test starts a Ray of its own in a child process (this process may hold the session's Ray); the
start's retry is tested with a stand-in for ``ray.init`` and a fake clock, so no test waits for Ray's 30 s.
"""
import ipaddress
import json
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("ray")  # every test here starts Ray, or stands in for ray.init inside Ray's start-up

import alpa_like as al
from alpa_like import api
from alpa_like.runtime import ray_startup
from alpa_like.runtime.ray_startup import LOOPBACK, start_local_ray

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
               "to startup or the GCS has become overloaded.")  # Ray's message

# Run in a child process: al.init starts the local Ray, the child reports what its Ray processes listen on.
LISTENERS_SCRIPT = """
import json, os, psutil, ray
import alpa_like as al
from alpa_like import api
from ray._raylet import AuthenticationMode, get_authentication_mode

al.init(cluster="ray", num_nodes=1, num_devices_per_node=1)
me = psutil.Process()
listening = sorted({c.laddr.ip for p in [me, *me.children(recursive=True)]
                    for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
report = dict(node_ip=ray.nodes()[0]["NodeManagerAddress"], listening=listening,
              token_auth=get_authentication_mode() == AuthenticationMode.TOKEN, temp_dir=api._backend.ray.temp_dir)
al.shutdown()
report["temp_dir_left"] = os.path.exists(report["temp_dir"])
print(json.dumps(report))
"""


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket bound to loopback
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.ray
def test_the_local_ray_listens_on_loopback_only_with_token_auth():
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", LISTENERS_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["node_ip"] == LOOPBACK
    assert report["listening"] and all(is_loopback(ip) for ip in report["listening"]), report["listening"]
    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "token":  # RAY_AUTH_MODE=disabled is the user's call
        assert report["token_auth"]
    assert not report["temp_dir_left"]


@pytest.mark.ray
def test_shutdown_removes_the_temp_dir_the_backend_made(ray_session):
    al.init(cluster="ray", num_nodes=1, num_devices_per_node=2)
    temp_dir = api._backend.ray.temp_dir
    assert os.path.isdir(temp_dir)
    al.shutdown()
    assert not os.path.exists(temp_dir)


class FakeInit:
    """``ray.init``'s stand-in: raises the given errors in turn, then returns a context; each call moves the
    clock by ``seconds``."""

    def __init__(self, errors, seconds: float = 31.0, node_ip: str = LOOPBACK):
        self.errors, self.seconds, self.node_ip = list(errors), seconds, node_ip
        self.now, self.calls, self.gcs_waits = 0.0, [], []

    def clock(self) -> float:
        return self.now

    def __call__(self, **options):
        self.calls.append(options)
        self.gcs_waits.append(os.environ.get(ray_startup.GCS_PORT_WAIT_VARIABLE))
        self.now += self.seconds
        if self.errors:
            raise self.errors.pop(0)
        return types.SimpleNamespace(address_info={"node_ip_address": self.node_ip})


@pytest.fixture
def no_gcs_wait_set(monkeypatch):
    monkeypatch.delenv(ray_startup.GCS_PORT_WAIT_VARIABLE, raising=False)


def test_a_start_that_timed_out_is_tried_again_on_loopback(no_gcs_wait_set):
    init = FakeInit([Exception(RAY_TIMEOUT)])
    context = start_local_ray(num_cpus=2, startup_timeout=180, init=init, clock=init.clock)
    assert context.address_info["node_ip_address"] == LOOPBACK
    assert len(init.calls) == 2
    assert all(c["address"] == "local" and c["_node_ip_address"] == LOOPBACK and c["include_dashboard"] is False
               for c in init.calls)
    # Ray's GCS port wait gets what is left of the budget, and is unset again after.
    assert init.gcs_waits == ["180", "149"]
    assert ray_startup.GCS_PORT_WAIT_VARIABLE not in os.environ


def test_a_gcs_port_wait_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(ray_startup.GCS_PORT_WAIT_VARIABLE, "7")
    init = FakeInit([])
    start_local_ray(num_cpus=2, startup_timeout=180, init=init, clock=init.clock)
    assert init.gcs_waits == ["7"] and os.environ[ray_startup.GCS_PORT_WAIT_VARIABLE] == "7"


def test_a_spent_startup_timeout_raises_saying_what_happened_and_how_to_allow_longer(no_gcs_wait_set):
    init = FakeInit([Exception(RAY_TIMEOUT)] * 5)
    with pytest.raises(RuntimeError, match=r"startup timed out \(2 tries in 62 s, startup_timeout=60 s; Ray said: "
                                           r"The current node timed out.*loaded.*al.init\(cluster='ray', "
                                           r"startup_timeout=\.\.\.\)"):
        start_local_ray(num_cpus=2, startup_timeout=60, init=init, clock=init.clock)
    assert len(init.calls) == 2


def test_other_start_errors_are_not_retried(no_gcs_wait_set):
    init = FakeInit([ValueError("When connecting to an existing cluster, num_cpus must not be provided.")])
    with pytest.raises(ValueError, match="num_cpus must not be provided"):
        start_local_ray(num_cpus=2, startup_timeout=180, init=init, clock=init.clock)
    assert len(init.calls) == 1


def test_the_processes_of_a_half_started_node_are_stopped(no_gcs_wait_set):
    ray_node = pytest.importorskip("ray._private.node")
    stopped = []

    class HalfStartedNode(ray_node.Node):
        """Times out in ``__init__`` like a node whose raylet never registered."""

        def __init__(self):
            raise Exception(RAY_TIMEOUT)

        def kill_all_processes(self, check_alive=True, allow_graceful=False, wait=False):
            stopped.append(self)

    calls = []

    def init(**options):
        calls.append(options)
        if len(calls) == 1:
            HalfStartedNode()
        return types.SimpleNamespace(address_info={"node_ip_address": LOOPBACK})

    start_local_ray(num_cpus=2, startup_timeout=180, init=init)
    assert len(calls) == 2 and len(stopped) == 1


def test_a_local_ray_off_loopback_is_shut_down_and_refused(monkeypatch, no_gcs_wait_set):
    ray = pytest.importorskip("ray")
    shutdowns = []
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    init = FakeInit([], node_ip="10.1.2.3")
    with pytest.raises(RuntimeError, match=r"node IP 10\.1\.2\.3, not 127\.0\.0\.1.*shut down"):
        start_local_ray(num_cpus=2, startup_timeout=180, init=init, clock=init.clock)
    assert shutdowns == [True]


@pytest.mark.parametrize("value", [0, -1.0, "60", True, float("nan"), float("inf")])
def test_startup_timeout_must_be_finite_positive_seconds(value):
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=rf"startup_timeout must be a finite number of seconds > 0, got {value!r}"):
        al.init(cluster="ray", startup_timeout=value)
