"""SGLang 0.5.23's weight-update session and its one-call-at-a-time rule, on the embedded engine.

What SGLang does (srt/managers/scheduler_components/weight_updater.py, SchedulerWeightUpdaterManager;
srt/managers/tokenizer_control_mixin.py; srt/entrypoints/http_server.py):
- /begin_weight_update {selector: "all" | "target" | "draft"} opens a session; a second begin while
  one is open answers success=false "a weight-update session is already open; call
  end_weight_update() first". /end_weight_update without one answers success=false "no
  weight-update session is open; call begin_weight_update() first". Both routes answer 400 on
  success=false, 200 otherwise.
- /update_weights_from_distributed and /update_weights_from_tensor outside a session answer 400
  "<endpoint> must run between begin_weight_update() and end_weight_update()" BEFORE touching
  the process group: the engine never joins that bucket's broadcast.
- End runs the runners' post-load step only when no update loaded weights in the session (an
  out-of-band load, P2P/RDMA); with loads it has nothing to finalize here (no quantized
  weights to repack), so the embedded engine's end only closes the session.
- The tokenizer manager holds one lock (the writer side of model_update_lock, or is_pause_cond
  while paused) for the WHOLE of each weight-update call, and the scheduler runs one request at a
  time, group init included: an engine blocked in one group's broadcast serves nothing else.
  `call_lock` is that lock here, taken by the server around every weight-sync endpoint, so two
  callers that reach two engines in opposite orders deadlock here as they would on SGLang.
"""

from __future__ import annotations

import threading

from slime_rl.engines.embedded.sampling import RequestError

SELECTORS = ("all", "target", "draft")
SESSION_ENDPOINTS = ("/begin_weight_update", "/end_weight_update")
# the endpoints SGLang refuses outside a session
NEED_SESSION = ("/update_weights_from_distributed", "/update_weights_from_tensor")


class WeightUpdateSession:
    def __init__(self) -> None:
        self.call_lock = threading.Lock()  # held across each whole weight-update call (see above)
        self.selector: str | None = None  # the open session's selector; None: no session
        self.loaded_weights = False  # an update loaded weights in the open session

    @property
    def is_open(self) -> bool:
        return self.selector is not None

    def begin(self, body: object) -> tuple[bool, str]:
        selector = body.get("selector", "all") if isinstance(body, dict) else "all"
        if selector not in SELECTORS:
            raise RequestError(f"selector: {selector!r} is not one of {list(SELECTORS)}")
        if self.is_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.selector, self.loaded_weights = selector, False
        return True, "Success"

    def end(self, body: object) -> tuple[bool, str]:
        if not self.is_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.selector, self.loaded_weights = None, False
        return True, "Success"

    def refusal(self, path: str) -> str | None:
        """SGLang's message when `path` needs a session and none is open; None when it may run."""
        if path in NEED_SESSION and not self.is_open:
            return f"{path.lstrip('/')} must run between begin_weight_update() and end_weight_update()"
        return None

    def note_result(self, path: str, ok: bool) -> None:
        if ok and path in NEED_SESSION:
            self.loaded_weights = True
