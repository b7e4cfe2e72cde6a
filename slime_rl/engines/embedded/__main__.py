"""`python -m slime_rl.engines.embedded --model-path DIR --port N ...`: serve one embedded engine."""

import logging
import os
import sys

from slime_rl.engines.embedded.cli import main

if __name__ == "__main__":
    main()
    # Shut down cleanly (every request answered, the port closed): the interpreter's own teardown with
    # torch and transformers loaded takes over a second more (1.3 s on 2 cores), which every engine stop
    # and restart waited for. Logs are flushed; exit code 0 as before.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
