"""A progress bar of the e2e harness's steps (``bench/runner.py``)."""

from __future__ import annotations

import math
import sys
import time


class Progress:
    """A progress bar over ``total`` steps: tqdm when installed, else a plain line at the first step, every
    ``every_s`` seconds and at the end (flushed; the same in a terminal and a CI log). Disabled: silent."""

    def __init__(self, total: int, desc: str, enabled: bool = True, every_s: float = 10.0) -> None:
        self.total, self.desc, self.enabled, self.every_s = total, desc, enabled, every_s
        self.done, self.t0, self.last, self.bar = 0, time.monotonic(), -math.inf, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stdout, ascii=True, mininterval=1.0)
            except ImportError:
                self.bar = None

    def update(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if self.done in (1, self.total) or now - self.last >= self.every_s:
            self.last = now
            print(f"{self.desc}: {self.done}/{self.total} steps, {now - self.t0:.1f} s {note}".rstrip(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        sys.stdout.flush()
