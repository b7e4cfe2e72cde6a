"""`python -m slime_rl.engines.embedded`: the built-in engine's command line. Its flags and the
--config-json the driver passes are both read by config/builtin_engine.py's one parser (flag names
are SGLang's ServerArgs names where SGLang has the option).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from slime_rl.config.builtin_engine import parse_server_args
from slime_rl.engines.embedded.server import EmbeddedServer


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (flags or --config-json: config/builtin_engine.py), load the model and
    serve until SIGTERM/SIGINT."""
    cfg = parse_server_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = EmbeddedServer(cfg)

    def stop(signum: int, _frame) -> None:
        # serve_forever runs in this thread; shutdown() must be called from another one.
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        signal.signal(signal.SIGTERM, stop)
    print(f"embedded engine serving {cfg.model_path} at {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
