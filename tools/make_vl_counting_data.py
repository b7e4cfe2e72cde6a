"""Write the synthetic visual counting task: `python tools/make_vl_counting_data.py --out DIR/train.jsonl`.

Rows are EasyR1-style {"problem": "<image>How many red shapes ...", "answer": "3", "images":
["train_images/00000.png"]}; the PNGs (drawn with pillow, see slime_rl/data/vl_counting.py) go to
a folder next to the jsonl, named after it, and the rows hold paths relative to the jsonl, so the
folder can be moved as a whole. Train with `--input-key problem --label-key answer --image-key
images --rm-type digit` (configs/vl_counting_cpu.yaml).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from slime_rl.data.vl_counting import make_rows, write_jsonl


def make_data(out: str | Path, n: int, seed: int, size: int = 112) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = make_rows(n, seed, out.parent / f"{out.stem}_images", size)
    return write_jsonl(rows, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the jsonl file; images go to <stem>_images/ beside it")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=112, help="image side in pixels (112 = 4x4 cells of 28)")
    a = p.parse_args(argv)
    print(f"wrote {make_data(a.out, a.n, a.seed, a.size)}")


if __name__ == "__main__":
    main()
