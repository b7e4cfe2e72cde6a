"""The peers' own code (verl, AReaL) for equality tests: launch/setup.sh installs the pinned list of
launch/peers.txt, without dependencies, into <venv>/peers; `run_peers` runs their functions
(tests/peer_calls.py) in a process of its own with that folder first on sys.path, since their pinned
dependencies differ from ours (omegaconf 2.4 needs antlr4 4.9.3; math-verify here, 4.13). Torch and numpy
come from our venv. A missing install fails the test with the command that fixes it (a peer comparison that
skips would rot unseen).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PEERS_DIR = Path(sys.prefix) / "peers"


def run_peers(calls: list[dict], tmp: Path) -> list[dict]:
    """Run `calls` (tests/peer_calls.py's CALLS by name, with their arguments) in one process whose sys.path
    starts with PEERS_DIR; returns one result dict per call. A failure raises with the process's stderr."""
    import subprocess

    import torch

    assert (PEERS_DIR / ".peers.txt").is_file(), (
        f"the peers' code is not installed in {PEERS_DIR}: run `bash launch/setup.sh` (launch/peers.txt)")
    src, dst = tmp / "peer_in.pt", tmp / "peer_out.pt"
    torch.save(calls, src)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PEERS_DIR), str(root)])}
    proc = subprocess.run([sys.executable, "-m", "tests.peer_calls", str(src), str(dst)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"tests/peer_calls.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return torch.load(dst)
