"""The in-process Ray the stages start keeps every server on loopback."""
import pytest


def test_in_process_ray_listens_on_loopback_only(ray_session, tcp_listeners, loopback_addresses):
    if tcp_listeners is None:
        pytest.skip("reads listening sockets from /proc (Linux)")
    ray = ray_session
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}

    @ray.remote
    def ping() -> int:
        return 1

    assert ray.get([ping.remote() for _ in range(2)]) == [1, 1]  # worker processes up and serving
    found = tcp_listeners()
    # GCS, raylet (node manager and object manager), agents, the workers' own servers.
    assert len(found) >= 4
    assert {addr for addr, _ in found} <= loopback_addresses, sorted(found)
