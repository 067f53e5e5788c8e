"""The Prometheus collector of a server: every metric is computed from ``server.stats()``
when scraped (a custom collector), so the exported figures are the run's own statistics,
never a second count kept on the hot path."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .. import __version__
from ..server.core import REFUSAL_CODES

if TYPE_CHECKING:
    from . import Monitor

#: upper bounds (σ <= le) of the staleness histogram's buckets; σ is an integer
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
#: the longest learner name exported as a label (names come from the learners' hellos)
MAX_NAME = 64


def cumulative(histogram: dict[str, int], bounds: Sequence[int]) -> list[int]:
    """Cumulative counts (σ <= each bound) of a ``{"σ": count}`` histogram as in ``stats()``."""
    return [sum(c for s, c in histogram.items() if int(s) <= bound) for bound in bounds]


class ServerCollector(Collector):
    """Reads ``monitor.server`` at each scrape."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        monitor = self.monitor
        ps = monitor.server
        stats = ps.stats(loss_curve=False)
        yield from self._server(stats)
        yield from self._staleness(stats)
        yield from self._traffic(stats["traffic"])
        yield from self._checkpoint(stats["checkpoint"])
        yield from self._learners(monitor._shown(stats["learners"]))

    def _server(self, stats: dict[str, Any]) -> Iterator[Metric]:
        ps = self.monitor.server
        info = {
            "version": __version__,
            "protocol": str(stats["protocol"]),
            "lr_policy": str(stats["lr_policy"]),
            "kernel": str(stats["kernel"]),
            "shard": str(stats["shard"]),
        }
        yield InfoMetricFamily("rudra_server", "What this parameter server runs.", value=info)
        yield GaugeMetricFamily("rudra_clock", "The server clock: updates applied to the weights.", value=ps.clock)
        yield GaugeMetricFamily(
            "rudra_updates_per_second",
            "Updates per second over the last 10 seconds, as the server computes it (0 once no learner is "
            "connected and updates stopped); for queries, prefer rate(rudra_clock[...]) or rate(rudra_samples_total).",
            value=self.monitor.updates_per_s(),
        )
        connected = sum(1 for v in stats["learners"].values() if v["connected"])
        yield GaugeMetricFamily("rudra_learners", "Connected learners (λ).", value=connected)
        yield GaugeMetricFamily(
            "rudra_learners_blocked", "Learners whose request waits on the protocol now.", value=len(ps.blocked)
        )
        yield GaugeMetricFamily(
            "rudra_gradient_buffers_in_use",
            "Large pushed gradients being received or read now, of --gradient-buffers (held ones not counted).",
            value=ps.bodies.in_use,
        )
        yield GaugeMetricFamily(
            "rudra_gradient_buffers_waiting",
            "Connections whose push waits for a gradient buffer now.",
            value=ps.bodies.waiting,
        )
        yield CounterMetricFamily(
            "rudra_gradients_applied", "Gradients folded into an update.", value=stats["gradients"]
        )
        yield CounterMetricFamily(
            "rudra_gradients_dropped", "Gradients the protocol dropped (e.g. late backup ones).", value=stats["dropped"]
        )
        rejected = CounterMetricFamily(
            "rudra_rejected", "Requests refused, by error code (wire.md lists the codes).", labels=["code"]
        )
        counts = {**dict.fromkeys(REFUSAL_CODES, 0), **stats["rejected"]}  # every code from zero: rate() works
        for code, count in sorted(counts.items()):
            rejected.add_metric([code], count)
        yield rejected
        yield CounterMetricFamily(
            "rudra_samples", "Training samples the applied gradients covered.", value=stats["samples"]
        )
        yield CounterMetricFamily(
            "rudra_update_seconds", "Time spent in the update kernel.", value=stats["update_seconds"]
        )

    def _staleness(self, stats: dict[str, Any]) -> Iterator[Metric]:
        histogram = stats["staleness_histogram"]
        counts = cumulative(histogram, STALENESS_BUCKETS)
        bounds = [str(floatToGoString(b)) for b in STALENESS_BUCKETS]  # type: ignore[no-untyped-call]
        buckets = [*zip(bounds, counts), ("+Inf", stats["gradients"])]
        yield HistogramMetricFamily(
            "rudra_staleness",
            "Staleness σ = clock - timestamp of each applied gradient.",
            buckets=buckets,
            sum_value=sum(int(s) * c for s, c in histogram.items()),
        )

    def _traffic(self, traffic: dict[str, dict[str, int]]) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "rudra_transport_received_bytes", "Bytes received, by transport.", labels=["transport"]
        )
        sent = CounterMetricFamily("rudra_transport_sent_bytes", "Bytes sent, by transport.", labels=["transport"])
        for scheme, counts in sorted(traffic.items()):
            received.add_metric([scheme], counts["bytes_in"])
            sent.add_metric([scheme], counts["bytes_out"])
        yield received
        yield sent

    def _checkpoint(self, ckpt: dict[str, Any]) -> Iterator[Metric]:
        yield CounterMetricFamily("rudra_checkpoints_written", "Checkpoints written.", value=ckpt["written"])
        yield CounterMetricFamily(
            "rudra_checkpoint_failures", "Checkpoints that failed (training went on).", value=ckpt["failed"]
        )
        if ckpt.get("written_at"):
            yield GaugeMetricFamily(
                "rudra_checkpoint_last_written_timestamp_seconds",
                "When the newest checkpoint file was written (Unix time; its age is time() - this).",
                value=ckpt["written_at"],
            )
        if ckpt.get("clock") is not None:
            yield GaugeMetricFamily(
                "rudra_checkpoint_clock", "The clock of the newest checkpoint written.", value=ckpt["clock"]
            )

    def _learners(self, learners: dict[str, Any]) -> Iterator[Metric]:
        labels = ["learner", "name"]
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "gradients": CounterMetricFamily(
                "rudra_learner_gradients", "Gradients of this learner applied.", labels=labels
            ),
            "dropped": CounterMetricFamily(
                "rudra_learner_dropped", "Gradients of this learner dropped.", labels=labels
            ),
            "staleness_mean": GaugeMetricFamily(
                "rudra_learner_staleness_mean", "Mean σ of this learner's applied gradients.", labels=labels
            ),
            "last_seen": GaugeMetricFamily(
                "rudra_learner_last_seen_timestamp_seconds",
                "When a request of this learner last arrived or was answered (Unix time).",
                labels=labels,
            ),
            "connected": GaugeMetricFamily(
                "rudra_learner_connected", "1 while the learner is connected, 0 once it left.", labels=labels
            ),
        }
        wall = time.time()
        for key, info in learners.items():
            values = [key, str(info["name"])[:MAX_NAME]]
            info = {**info, "last_seen": wall - info["last_seen_s"]}
            for field, family in families.items():
                family.add_metric(values, float(info[field]))
        yield from families.values()
