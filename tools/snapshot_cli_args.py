"""Write the checked-in snapshots of SGLang's and sglang-router's command-line flags.

    python tools/snapshot_cli_args.py            # both; each needs its package importable
    python tools/snapshot_cli_args.py sglang     # slime_rl/engines/sglang_server_args.json
    python tools/snapshot_cli_args.py router     # slime_rl/engines/sglang_router_args.json

The tables are read from the programs' own argparse parsers (`ServerArgs.add_cli_args`,
`RouterArgs.add_cli_args`), so the snapshot holds what `python -m sglang.launch_server` and
`python -m sglang_router.launch_router` accept: option names, dests and value shapes. SGLang's
server args import on a CPU machine after `pip install --no-deps sglang` plus its light
dependencies (see /work/shared/FACTS.md); sglang-router is a binary wheel that runs on CPU.
"""

from __future__ import annotations

import json
import sys

from slime_rl.engines.cli_args import ROUTER_SNAPSHOT, SGLANG_SNAPSHOT, router_table, sglang_server_table


def _compact(data: dict) -> str:
    """JSON with one option per line and eight field names per line: diffs between versions stay readable."""
    fields = data["fields"]
    rows = [", ".join(json.dumps(f) for f in fields[i:i + 8]) for i in range(0, len(fields), 8)]
    opts = [f"  {json.dumps(n)}: {json.dumps(v)}" for n, v in data["options"].items()]
    return ("{\n" + f' "program": {json.dumps(data["program"])},\n "fields": [\n  ' + ",\n  ".join(rows)
            + "\n ],\n \"options\": {\n" + ",\n".join(opts) + "\n }\n}\n")


def main(argv: list[str]) -> int:
    which = argv or ["sglang", "router"]
    for name in which:
        table, path = {"sglang": (sglang_server_table, SGLANG_SNAPSHOT),
                       "router": (router_table, ROUTER_SNAPSHOT)}[name]
        table = table()
        if table.source != "live":
            print(f"{name}: the package does not import here; the snapshot was left as it is", file=sys.stderr)
            return 1
        path.write_text(_compact(table.to_json()))
        print(f"{path}: {table.program}, {len(table.options)} options, {len(table.fields)} fields")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
