"""What the worker says about itself: its identity, lane and advert, its load, its usage
records, its Prometheus metrics and their server, where its start-up seconds went.
A docstring only: the sub-room adds nothing to what a worker imports (``docs/worker.md``)."""
