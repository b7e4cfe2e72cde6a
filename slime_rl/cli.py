"""`slime-rl` console script: `slime-rl train ...` and `slime-rl engine ...`."""

from __future__ import annotations

import sys

USAGE = """usage: slime-rl {train,engine} [flags]
  train   run RL training (slime-rl train --help)
  engine  serve the built-in rollout engine over SGLang's HTTP protocol (slime-rl engine --help)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from slime_rl.train import main as train_main

        return train_main(rest)
    if command == "engine":
        from slime_rl.engines.embedded.cli import main as engine_main

        return engine_main(rest) or 0
    print(f"slime-rl: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
