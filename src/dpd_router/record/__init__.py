"""A request's record and what reads it: the trace and its observer (observe: metrics, the log line, spans),
the metric families and their reference (metrics, metrics_reference), the log format and writer (logs),
OpenTelemetry spans (tracing), and the frozen outcome the learners get (outcome)."""
