"""`python -m slime_rl.engines.embedded --model-path DIR --port N ...`: serve one embedded engine."""

from slime_rl.engines.embedded.cli import main

if __name__ == "__main__":
    main()
