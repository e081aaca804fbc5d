"""A session's life at the worker: the admission line, the door (grants, secrets, per-client
limits), the session table, its published closes, the closes that arrive before their opens,
and the closes the worker makes by itself.
A docstring only: the sub-room adds nothing to what a worker imports (``docs/worker.md``)."""
