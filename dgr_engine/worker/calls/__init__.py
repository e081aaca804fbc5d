"""The worker's calls: the ``Shard`` and ``Chain`` services, their registration, the per-frame
path both run, and the two other ports (the frame link, the native links' control shell).
A docstring only: the sub-room adds nothing to what a worker imports (``docs/worker.md``)."""
