"""A 3-node nats-server JetStream cluster on 127.0.0.1, for tests of what a fleet deployment
meets: a node killed with ``kill -9``, a stream leader elected again, a node rejoining.

A test module takes the ``nats_cluster`` fixture by importing it::

    from nats_cluster import nats_cluster_fixture  # noqa: F401  (pytest finds it by name)

    def test_x(nats_cluster): ...

The fixture is module-scoped (one cluster for the module's tests: starting one costs well
under a second, stopping it about as much); a test that kills a node restarts it before it
ends. nats-py takes several servers as a list (``urls``), kvctl's options as one
comma-joined string (``url``).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from conftest import free_port, nats_server_binary

CLUSTER_SIZE = 3
LOG_TAIL_LINES = 20


class ClusterNode:
    """One nats-server of the cluster: its ports and store dir stay the same across restarts."""

    def __init__(
        self, index: int, root: Path, cluster_name: str, ports: tuple[int, int, int]
    ) -> None:
        self.index = index
        self.name = f"n{index}"
        self.cluster_name = cluster_name
        self.port, self.cluster_port, self.monitor_port = ports
        self.store = root / self.name
        self.log_path = root / f"{self.name}.log"
        self.url = f"nats://127.0.0.1:{self.port}"
        self.route = f"nats://127.0.0.1:{self.cluster_port}"
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self, routes: list[str]) -> None:
        assert not self.running, f"{self.name} is already running"
        self._close_log()
        # appended to: a restarted node's log follows the one of its earlier life
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (kept open while the node runs)
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "--server_name",
                self.name,
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-m",
                str(self.monitor_port),
                "-js",
                "--store_dir",
                str(self.store),
                "--cluster_name",
                self.cluster_name,
                "--cluster",
                self.route,
                "--routes",
                ",".join(routes),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            # its own process group, killed as a whole, as an operator's kill -9 of a
            # service would; the atexit guard of NatsCluster covers an interrupted run
            start_new_session=True,
        )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the node's process group: no shutdown, no leader step-down."""
        assert self.proc is not None and self.running, f"{self.name} is not running"
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (nats-server shuts down cleanly), SIGKILL if it overstays 10 s."""
        if self.proc is not None and self.running:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def monitor(self, path: str) -> tuple[int, str]:
        """(HTTP status, body) of the node's monitoring endpoint; status 0 when unreachable."""
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:  # /healthz answers 503 with the reason
            return error.code, error.read().decode()
        except OSError as error:
            return 0, str(error)

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])


class NatsCluster:
    """Three JetStream nodes routed to each other; every node's process stopped by
    :meth:`stop`, which also runs at interpreter exit if a run is cut short."""

    def __init__(self, root: Path, cluster_name: str = "kvctl-test") -> None:
        ports = _distinct_free_ports(3 * CLUSTER_SIZE)  # client, route, monitoring per node
        self.nodes = [
            ClusterNode(i, root, cluster_name, (ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]))
            for i in range(CLUSTER_SIZE)
        ]
        self.urls = [node.url for node in self.nodes]
        self.url = ",".join(self.urls)

    def start(self, timeout: float = 30) -> None:
        atexit.register(self.stop)
        for node in self.nodes:
            node.start(self._routes_of(node))
        self.wait_healthy(timeout)

    def stop(self) -> None:
        for node in self.nodes:  # all told first: they shut down side by side
            if node.running:
                assert node.proc is not None
                node.proc.terminate()
        for node in self.nodes:
            node.stop()
        atexit.unregister(self.stop)

    def __enter__(self) -> NatsCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (its process group); returns once the process is gone."""
        self.nodes[index].kill()

    def restart(self, index: int, timeout: float = 30) -> None:
        """Start node ``index`` again on its ports and store dir; returns once it has rejoined
        and is current (meta group, and per its /healthz, every stream it holds)."""
        node = self.nodes[index]
        node.start(self._routes_of(node))
        self.wait_healthy(timeout)

    def index_of(self, server_name: str) -> int:
        """The node of a server name (as stream info's ``cluster.leader`` gives it)."""
        for node in self.nodes:
            if node.name == server_name:
                return node.index
        raise KeyError(f"no node named {server_name!r} in {[n.name for n in self.nodes]}")

    def wait_healthy(self, timeout: float = 30) -> str:
        """Wait until every running node answers /healthz (JetStream current, streams
        included), all agree on a meta leader, and the leader sees every other running node
        as a current peer. Returns the meta leader's name; raises with each node's log tail
        after ``timeout`` or when a node exits that was not killed."""
        deadline = time.monotonic() + timeout
        while True:
            why_not = self._why_unhealthy()
            if why_not is None:
                return self._meta_leader()
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"cluster not healthy within {timeout} s: {why_not}\n{self._log_tails()}"
                )
            time.sleep(0.05)  # polling the readiness signal: nothing to wait on instead

    def _routes_of(self, node: ClusterNode) -> list[str]:
        return [other.route for other in self.nodes if other is not node]

    def _jsz_meta(self, node: ClusterNode) -> dict[str, Any]:
        status, body = node.monitor("/jsz")
        if status != 200:
            return {}
        return json.loads(body).get("meta_cluster") or {}

    def _meta_leader(self) -> str:
        live = [node for node in self.nodes if node.running]
        return str(self._jsz_meta(live[0]).get("leader", ""))

    def _why_unhealthy(self) -> str | None:
        """None when healthy, else the first reason it is not (for the failure message)."""
        for node in self.nodes:
            if node.proc is not None and node.proc.returncode not in (None, -signal.SIGKILL):
                raise AssertionError(
                    f"{node.name} exited with code {node.proc.returncode}\n{self._log_tails()}"
                )
        live = [node for node in self.nodes if node.running]
        if not live:
            return "no node running"
        metas = {}
        for node in live:
            status, body = node.monitor("/healthz")
            if status != 200:
                return f"{node.name} /healthz {status}: {body.strip()}"
            metas[node.name] = self._jsz_meta(node)
        leaders = {meta.get("leader") for meta in metas.values()}
        if len(leaders) != 1 or not next(iter(leaders)):
            return f"no agreed meta leader: {sorted(map(str, leaders))}"
        leader = str(next(iter(leaders)))
        if leader not in metas:
            return f"meta leader {leader} is not a running node"
        peers = {peer["name"]: peer for peer in metas[leader].get("replicas", [])}
        for node in live:
            peer = peers.get(node.name, {})
            if node.name != leader and (not peer.get("current") or peer.get("offline")):
                return f"{node.name} is not a current peer of meta leader {leader}: {peer}"
        return None

    def _log_tails(self) -> str:
        return "\n".join(
            f"--- {node.name} ({node.url}) log tail ---\n{node.log_tail()}" for node in self.nodes
        )


async def wait_stream_current(js: Any, stream: str, timeout: float = 15) -> Any:
    """Stream info (nats-py's) once the stream has a leader and every other replica is current
    (caught up, as its leader sees it): a node restarted under writes lags a moment."""
    deadline = time.monotonic() + timeout
    while True:
        info = await js.stream_info(stream)
        if info.cluster and info.cluster.leader:
            followers = info.cluster.replicas or []
            expected = (info.config.num_replicas or 1) - 1
            if len(followers) == expected and all(peer.current for peer in followers):
                return info
        assert time.monotonic() < deadline, f"stream {stream} not current in {timeout} s: {info}"
        await asyncio.sleep(0.05)


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    for _ in range(count * 10):
        port = free_port()
        if port not in ports:
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} distinct free ports")


@pytest.fixture(scope="module", name="nats_cluster")
def nats_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path_factory.mktemp("nats-cluster")) as cluster:
        yield cluster
