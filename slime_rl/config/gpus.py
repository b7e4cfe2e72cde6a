"""The GPUs a `--dry-run --cluster NODESxGPUS:GPU` plan can be judged against, by name or by size
(orchestration/fit.py gives the verdicts)."""

from __future__ import annotations

from dataclasses import dataclass

# nvidia-smi's memory.total of each GPU, in MiB (what torch.cuda.mem_get_info()[1] reports), by the
# names `--cluster NODESxGPUS:NAME` takes; a number instead of a name is GiB
GPU_MIB = {
    "H100": 81559, "H800": 81559, "H200": 143771, "H20": 97871, "A100": 81920, "A100-80": 81920, "A800": 81920,
    "A100-40": 40960, "B200": 183359, "L40S": 46068,
}


@dataclass(frozen=True)
class GpuMemory:
    """The GPU a plan is judged against: its memory and how it was named."""

    gib: float
    name: str  # "H100", "80 GiB", or the local device's name


def parse_gpu(text: str) -> GpuMemory:
    """A GPU name of GPU_MIB (any case) or its memory in GiB (`80`, `80GiB`, `141gb`)."""
    name = text.strip()
    for known, mib in GPU_MIB.items():
        if name.upper() == known:
            return GpuMemory(mib / 1024, known)
    number = name.lower().removesuffix("gib").removesuffix("gb").strip()
    try:
        gib = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is neither a GPU name ({', '.join(GPU_MIB)}) nor a memory size in GiB "
                         "(e.g. 80)") from None
    if not 0 < gib < 10_000:
        raise ValueError(f"{text!r}: a GPU's memory in GiB must be between 0 and 10000")
    return GpuMemory(gib, f"{gib:g} GiB")
