"""Serve OpenEnv's own template environment on a port: `python openenv_echo_server.py FOLDER PORT`.

OpenEnv's `init` command (openenv 0.4.1, `openenv init echo_probe`) writes its template environment into FOLDER
(the echo environment: each action's message comes back as the observation, reward 0.1 per character, never
done); the environment, its action and its observation are then served, unchanged, by OpenEnv's own `create_app`
(HTTP and WebSocket), as the template's `server/app.py` does, with room for 8 sessions at once instead of its 1
(the rollout plays episodes concurrently). Run without `uv` on PATH: `init` then skips locking the template's
own dependencies (nothing installs them here). Prints `ready PORT` once the server answers."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from pathlib import Path

NAME = "echo_probe"


def main() -> None:
    folder, port = Path(sys.argv[1]), int(sys.argv[2])
    from openenv.cli.commands.init import init

    init(NAME, str(folder))
    sys.path.insert(0, str(folder / NAME))
    import uvicorn
    from models import EchoProbeAction, EchoProbeObservation
    from openenv.core.env_server.http_server import create_app
    from server.echo_probe_environment import EchoProbeEnvironment

    app = create_app(EchoProbeEnvironment, EchoProbeAction, EchoProbeObservation, env_name=NAME,
                     max_concurrent_envs=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/schema", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    print(f"ready {port}", flush=True)
    thread.join()


if __name__ == "__main__":
    main()
