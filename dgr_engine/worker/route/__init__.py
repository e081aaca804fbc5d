"""A chained route's plumbing at one stage: where each session's output goes (the chain hub),
the stream to the next stage, the frames sent on, a drafting ring's last stage.
A docstring only: the sub-room adds nothing to what a worker imports (``docs/worker.md``)."""
