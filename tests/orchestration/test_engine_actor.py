"""The engine actor's launch: an engine that dies before it is healthy is named with its own last log
lines (the driver's error is all a CI run keeps), and the built-in engine's port is held by its actor
from the pick until the engine listens on it (a socket handed over, not a port bound again later)."""

from __future__ import annotations

import socket
import sys
import textwrap

import httpx
import pytest

from slime_rl.config.builtin_engine import LISTEN_FD_ENV

# a stand-in server on the built-in engine's own transport and socket hand-over, without its model
_SERVE_INHERITED = textwrap.dedent("""
    import sys
    from slime_rl.engines.embedded.http import HttpLimits, HttpServer, inherited_socket

    class Health:
        def check_head(self, method, path, headers):
            return None

        async def handle(self, method, path, body):
            return 200, {"path": path}

    sock = inherited_socket()
    assert sock is not None, "no socket handed over"
    HttpServer(sys.argv[1], int(sys.argv[2]), Health(), HttpLimits(), sock=sock).serve_forever()
""")


@pytest.fixture
def actor(ray_session):
    import ray

    from slime_rl.orchestration.engines import EngineActor

    a = EngineActor.options(num_cpus=0).remote(7)
    yield a
    ray.get(a.kill.remote())
    ray.kill(a)


def test_an_engine_that_exits_before_it_is_healthy_is_named_with_its_last_log_lines(actor):
    import ray

    from slime_rl.engines.launch import EngineLaunchError

    host, port = ray.get([actor.node_ip.remote(), actor.pick_port.remote()])
    cmd = [sys.executable, "-c", "print('loading tiny_glm4_moe'); print('config.json: no field num_experts'); "
                                 "raise SystemExit(3)"]
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(actor.start.remote(cmd, f"http://{host}:{port}", timeout=60))
    err = info.value.as_instanceof_cause()
    assert isinstance(err, EngineLaunchError)
    text = str(err)
    assert "exited with code 3" in text
    assert "loading tiny_glm4_moe" in text and "config.json: no field num_experts" in text


def test_a_held_port_cannot_be_taken_and_goes_to_the_engine(actor):
    import ray

    host, port = ray.get([actor.node_ip.remote(), actor.pick_port.remote(hold=True)])
    with socket.socket() as other, pytest.raises(OSError):  # held by the actor: nobody else binds it
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((host, port))
    url = f"http://{host}:{port}"
    assert ray.get(actor.start.remote([sys.executable, "-c", _SERVE_INHERITED, host, str(port)], url,
                                      timeout=60)) == url
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"path": "/health"}
    # the engine holds the port now, the actor no longer: it is still taken, by the engine's listener
    with socket.socket() as other, pytest.raises(OSError):
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((host, port))


def test_a_socket_handed_over_must_be_the_one_bound_to_the_engines_port(monkeypatch):
    from slime_rl.engines.embedded.http import HttpLimits, HttpServer, inherited_socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        wrong = s.getsockname()[1] + 1
        monkeypatch.setenv(LISTEN_FD_ENV, str(s.fileno()))
        got = inherited_socket()
        assert got is not None and got.getsockname() == s.getsockname()
        assert LISTEN_FD_ENV not in __import__("os").environ  # the engine's children do not inherit it
        with pytest.raises(ValueError, match=f"not 127.0.0.1:{wrong}"):
            HttpServer("127.0.0.1", wrong, None, HttpLimits(), sock=got)
        got.detach()  # s owns the fd
    monkeypatch.setenv(LISTEN_FD_ENV, "not-a-number")
    with pytest.raises(ValueError, match=LISTEN_FD_ENV):
        inherited_socket()


def test_a_node_part_that_serves_no_http_is_started_and_one_that_dies_at_once_is_named(actor):
    """Node parts 1.. of an engine over several nodes (SGLang --node-rank k) answer no /health: started, their
    pid back; one that exits in its first seconds fails the start with its log lines."""
    import ray

    from slime_rl.engines.launch import EngineLaunchError

    pid = ray.get(actor.start_part.remote([sys.executable, "-c", "import time; time.sleep(60)"]))
    assert pid == ray.get(actor.pid.remote())
    ray.get(actor.kill.remote())
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(actor.start_part.remote([sys.executable, "-c", "print('dist init 10.0.0.2:31555 refused'); "
                                                              "raise SystemExit(4)"], settle_s=30))
    err = info.value.as_instanceof_cause()
    assert isinstance(err, EngineLaunchError) and "exited with code 4" in str(err)
    assert "dist init 10.0.0.2:31555 refused" in str(err)
