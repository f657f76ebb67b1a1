"""Progress of a long phase: a tqdm bar on a terminal, one line a minute when stderr is a log file (`nohup`, CI),
so an hours-long `omniroll pretrain shapes-video` never runs silent."""

from __future__ import annotations

import sys
import time


class LogLines:
    """tqdm's interface as far as the pretraining uses it (`update`, `set_postfix`, `reset`, `refresh`, `close`,
    `n`), written as plain lines: `<desc>: <n>/<total> <unit>s (<pct> %), <rate> s/<unit>, ~<eta> min left, <postfix>`
    at most every `every_s` seconds, and once at the end."""

    def __init__(self, total: int, desc: str, unit: str = "step", every_s: float = 60.0, file=None):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.file = file if file is not None else sys.stderr
        self.n = self.last_print_n = self.initial = 0
        self.postfix = ""
        self.t0 = self.last = time.time()

    def reset(self, total: int | None = None) -> None:
        self.total = self.total if total is None else total
        self.n = self.last_print_n = self.initial = 0
        self.t0 = self.last = time.time()

    def update(self, k: int = 1) -> None:
        self.n += k
        if time.time() - self.last >= self.every_s:
            self.refresh()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def refresh(self) -> None:
        now = time.time()
        done = self.n - self.initial  # this run's steps (a resumed phase starts at `initial`)
        rate = (now - self.t0) / done if done else None
        parts = [f"{self.desc}: {self.n}/{self.total} {self.unit}s ({100 * self.n / max(self.total, 1):.0f} %)"]
        if rate is not None:
            parts.append(f"{rate:.2f} s/{self.unit}, ~{rate * (self.total - self.n) / 60:.0f} min left")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=self.file, flush=True)
        self.last, self.last_print_n = now, self.n

    def close(self) -> None:
        if self.n != self.last_print_n:
            self.refresh()


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "step"):
    """A tqdm bar when stderr is a terminal, `LogLines` when it is not, nothing (a disabled bar) when not `enabled`."""
    if enabled and not sys.stderr.isatty():
        return LogLines(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not enabled)
