"""Server metrics in the Prometheus text format (version 0.0.4), with no dependency.

HTTP side (counted by the server): requests by route and status code, requests and samples in flight, samples by
stop reason, request latency histogram by route. Engine side (read from the backend's `stats()` at scrape time):
denoising steps, forward rows (rows per step = rows / steps), requests running and waiting, weight version, sleep
level.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Optional

#: Latency histogram buckets, seconds (a tiny model at 2 steps is ~0.05 s; a 1024 px, 50-step batch minutes).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.samples: dict[str, int] = defaultdict(int)
        self.requests_in_flight = 0
        self.samples_in_flight = 0
        self._hist: dict[str, list[int]] = {}
        self._hist_sum: dict[str, float] = defaultdict(float)

    def request_started(self) -> None:
        with self._lock:
            self.requests_in_flight += 1

    def request_finished(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests_in_flight -= 1
            self.requests[(route, int(status))] += 1
            counts = self._hist.setdefault(route, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._hist_sum[route] += seconds

    def samples_started(self, n: int) -> None:
        with self._lock:
            self.samples_in_flight += n

    def samples_finished(self, n: int) -> None:
        with self._lock:
            self.samples_in_flight -= n

    def sample_done(self, stop_reason: Optional[str]) -> None:
        with self._lock:
            self.samples[stop_reason or "none"] += 1

    def render(self, engine_stats: Optional[dict] = None) -> str:
        with self._lock:
            lines = [
                "# HELP omniroll_http_requests_total HTTP requests served, by route and status code.",
                "# TYPE omniroll_http_requests_total counter",
            ]
            for (route, code), n in sorted(self.requests.items()):
                lines.append(f'omniroll_http_requests_total{{route="{route}",code="{code}"}} {n}')
            lines += [
                "# HELP omniroll_http_requests_in_flight HTTP requests being served now.",
                "# TYPE omniroll_http_requests_in_flight gauge",
                f"omniroll_http_requests_in_flight {self.requests_in_flight}",
                "# HELP omniroll_samples_in_flight Samples (images) requested over HTTP and not yet finished.",
                "# TYPE omniroll_samples_in_flight gauge",
                f"omniroll_samples_in_flight {self.samples_in_flight}",
                "# HELP omniroll_samples_total Samples finished over HTTP, by stop reason.",
                "# TYPE omniroll_samples_total counter",
            ]
            for reason, n in sorted(self.samples.items()):
                lines.append(f'omniroll_samples_total{{stop_reason="{reason}"}} {n}')
            lines += [
                "# HELP omniroll_request_latency_seconds HTTP request latency, by route.",
                "# TYPE omniroll_request_latency_seconds histogram",
            ]
            for route, counts in sorted(self._hist.items()):
                cum = 0
                for le, c in zip(self.buckets + (float("inf"),), counts):
                    cum += c
                    le_s = "+Inf" if le == float("inf") else repr(float(le))
                    lines.append(f'omniroll_request_latency_seconds_bucket{{route="{route}",le="{le_s}"}} {cum}')
                lines.append(f'omniroll_request_latency_seconds_sum{{route="{route}"}} {self._hist_sum[route]:.6f}')
                lines.append(f'omniroll_request_latency_seconds_count{{route="{route}"}} {cum}')
        lines += _engine_lines(engine_stats or {})
        return "\n".join(lines) + "\n"


def _engine_lines(stats: dict) -> list[str]:
    metrics = [
        ("omniroll_engine_steps_total", "counter", "Denoising steps run (one batched forward each).", "steps"),
        ("omniroll_engine_rows_total", "counter", "Forward rows run (a CFG request takes two per step); "
                                                  "rows per step = rows_total / steps_total.", "rows"),
        ("omniroll_engine_rows_per_step", "gauge", "Mean forward rows per denoising step since start.",
         "mean_rows_per_step"),
        ("omniroll_engine_requests_running", "gauge", "Requests being denoised now.", "running"),
        ("omniroll_engine_requests_waiting", "gauge", "Requests queued, not yet admitted.", "waiting"),
        ("omniroll_engine_served_total", "counter", "Samples the engine finished.", "served"),
        ("omniroll_engine_weight_version", "gauge", "Weight version samples are made with now.", "weight_version"),
        ("omniroll_engine_asleep_level", "gauge", "0 awake, 1 or 2 asleep.", "asleep_level"),
    ]
    lines = []
    for name, kind, help_, key in metrics:
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return lines
