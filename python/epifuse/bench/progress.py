"""A progress bar: tqdm when installed, else one plain line per step on stderr."""

from __future__ import annotations

import sys
import time

from . import EXTRA_HINT


class Progress:
    def __init__(self, total: int, desc: str = "bench", enabled: bool = True):
        self.total, self.count, self.desc = total, 0, desc
        self._t0 = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print(f"epifuse.bench: tqdm is not installed: plain progress lines; {EXTRA_HINT}",
                      file=sys.stderr, flush=True)
            else:
                self._bar = tqdm(total=total, desc=desc, unit="cfg", dynamic_ncols=True,
                                 file=sys.stderr)
        self.enabled = enabled

    def start(self, label: str) -> None:
        """Announce the step about to run."""
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=True)
        elif self.enabled:
            elapsed = time.perf_counter() - self._t0
            print(f"[{self.count + 1}/{self.total} {elapsed:6.0f}s] {label}", file=sys.stderr,
                  flush=True)

    def advance(self) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, msg: str) -> None:
        """Print a message without breaking the bar."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
