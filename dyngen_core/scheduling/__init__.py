"""The scheduler's parts: per-job sequence state, prefix reuse at admission, page bookkeeping.
`dyngen_core.scheduler.Scheduler` puts them together."""
