"""Progress bar: tqdm when importable, else a plain text bar (one line per step when not on a terminal)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str = "gdn bench", file=None, enabled: bool = True):
        self.total, self.desc, self.n = total, desc, 0
        self.file = file or sys.stderr
        self.enabled = enabled
        self.t0 = time.time()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=self.file, dynamic_ncols=True, leave=True)
            except Exception:
                self._bar = None

    def update(self, label: str = ""):
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label[:60], refresh=False)
            self._bar.update(1)
            return
        width = 30
        done = int(width * self.n / max(self.total, 1))
        tty = getattr(self.file, "isatty", lambda: False)()
        line = (f"{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} "
                f"{time.time() - self.t0:5.0f}s {label[:60]}")
        self.file.write(("\r" + line) if tty else (line + "\n"))
        self.file.flush()

    def close(self):
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and getattr(self.file, "isatty", lambda: False)():
            self.file.write("\n")
            self.file.flush()


__all__ = ["Progress"]
