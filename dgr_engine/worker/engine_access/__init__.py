"""How the worker reaches its engine: the checks before it loads, the one engine thread, where
each call runs, and co-batches of frames of different sessions.
A docstring only: the sub-room adds nothing to what a worker imports (``docs/worker.md``)."""
