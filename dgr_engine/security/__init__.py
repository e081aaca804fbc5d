"""What client and worker both read to trust each other: TLS (``tls``: what a worker serves
with and what a client trusts) and route grants (``grants``: the tracker's signed permission for
one session to use one stage, issued by the tracker, verified by the worker). Throwaway
certificate authorities for local runs are tooling (:mod:`dgr_engine.tooling.throwaway_ca`)."""
