"""Write the quickstart's prompt file: `python tools/make_digit_data.py --out FILE [--n N] [--seed S]`."""

from __future__ import annotations

import argparse

from slime_rl.data.digits import make_rows, write_jsonl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote {write_jsonl(make_rows(a.n, a.seed), a.out)}")


if __name__ == "__main__":
    main()
