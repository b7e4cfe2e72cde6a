"""CUDA IPC handles name their device by UUID (engines/tensor_ipc.py), as SGLang's patch of torch's
reducers does: a trainer rank sees its GPU as cuda:0, the engine's TP rank i sees the same GPU as
cuda:i. A sender process serializes a CUDA tensor; this process decodes it with the built-in engine's
restricted unpickler and gets the sender's memory on the device with that UUID. Marked `gpu`."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_rl.engines.tensor_ipc import deserialize_named_tensors

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SENDER = """
import sys, torch
from slime_rl.engines.tensor_ipc import serialize_named_tensors
t = torch.arange(1024, dtype=torch.float32, device="cuda") * 3
print(str(torch.cuda.get_device_properties(0).uuid), serialize_named_tensors([("w", t)]), flush=True)
sys.stdin.readline()
"""


def _received(visible: str) -> tuple[str, torch.Tensor, subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=visible)
    sender = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT)
    uuid, entry = sender.stdout.readline().split()
    assert uuid.encode() in base64.b64decode(entry)  # the device travels as its UUID, not as index 0
    [(name, got)] = deserialize_named_tensors(entry)
    assert name == "w"
    return uuid, got, sender


def _finish(sender: subprocess.Popen) -> None:
    sender.communicate("done\n", timeout=60)
    assert sender.returncode == 0


@pytest.mark.parametrize("gpu", [0, 1])
def test_a_handle_lands_on_the_device_with_its_uuid(gpu):
    if torch.cuda.device_count() <= gpu:
        pytest.skip(f"needs {gpu + 1} GPU(s)")
    uuid, got, sender = _received(str(gpu))  # the sender sees GPU `gpu` as its cuda:0
    try:
        assert got.device == torch.device("cuda", gpu)
        assert str(torch.cuda.get_device_properties(gpu).uuid) == uuid
        assert torch.equal(got, torch.arange(1024, dtype=torch.float32, device=got.device) * 3)
        del got
    finally:
        _finish(sender)
