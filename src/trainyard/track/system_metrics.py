"""System metrics of a training run (CPU, RAM, disk, network; GPU via NVML): MLflow's own
monitor, or, while the tracking server may go away, its samples through the fit's
``ServerGap`` (track.outage)."""

from __future__ import annotations

import logging

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from trainyard.track.outage import ServerGap

log = logging.getLogger(__name__)


class SystemMetrics:
    """MLflow's own system-metrics monitor (CPU, RAM, disk, network; GPU via NVML) on a run
    created outside the fluent API (Lightning's MLFlowLogger creates its run by client).
    With ``gap`` (the fit's ``ServerGap``) its samples are kept while the server is away,
    and an outage neither stops the sampling nor prints more than the gap's own line."""

    def __init__(
        self,
        run_id: str,
        tracking_uri: str,
        interval_s: float,
        enabled: bool,
        resume: bool = False,
        gap: ServerGap | None = None,
    ) -> None:
        self.monitor: SystemMetricsMonitor | None = None
        if not enabled:
            return

        # resume: a resumed run's samples continue after its last step, not over it
        if gap is not None:  # samples kept while the server is away (track.outage)
            self.monitor = GapMonitor(gap, interval_s, resume)
            return
        self.monitor = SystemMetricsMonitor(
            run_id, sampling_interval=interval_s, tracking_uri=tracking_uri, resume_logging=resume
        )

    def __enter__(self) -> SystemMetrics:
        if self.monitor is not None:
            self.monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.monitor is None:
            return
        self.monitor.finish()  # stops the sampling thread, flushes what it published
        # MLflow publishes only after a whole sampling interval: the samples of the last,
        # partial interval were dropped, and a fit shorter than one interval logged no system
        # metrics at all. Publish what was collected since the last publish.
        try:
            metrics = self.monitor.aggregate_metrics()
            if metrics:
                self.monitor.publish_metrics(metrics)
                self.monitor.mlflow_logger.flush()
        except Exception as err:  # a tracking hiccup must not fail a finished training
            log.warning("could not log the last system metrics sample: %s", err)


class GapMonitor(SystemMetricsMonitor):
    """MLflow's system-metrics sampler whose samples go through a ``ServerGap``. MLflow's own
    loop asks the server for the run's status at every sample, and at the first failure
    logs a warning and stops sampling for the rest of the fit."""

    def __init__(self, gap: ServerGap, interval_s: float, resume: bool) -> None:
        super().__init__(
            gap.run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=gap.uri
        )
        self.gap = gap

    def monitor(self) -> None:
        """Sample every interval and publish; the last, partial interval is the caller's."""
        while not self._shutdown_event.is_set():
            self.collect_metrics()
            if self._shutdown_event.wait(self.sampling_interval):
                return
            try:
                self.publish_metrics(self.aggregate_metrics())
            except Exception as err:  # not the server's absence: a bug, said once
                log.warning("system metrics stopped: %s", err)
                return

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        """The samples, prefixed ``system/``, through the gap."""
        prefix = self._metrics_prefix + (self.node_id + "/" if self.node_id else "")
        self.gap.log_metrics({prefix + k: v for k, v in metrics.items()}, self._logging_step)
        self._logging_step += 1
        for monitor in self.monitors:
            monitor.clear_metrics()
