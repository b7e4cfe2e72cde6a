"""Write docs/flags.md from the parser: `python tools/gen_flag_reference.py [--out docs/flags.md]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from slime_rl.config.reference import render_flag_reference


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "flags.md"))
    out = Path(p.parse_args(argv).out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_flag_reference())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
