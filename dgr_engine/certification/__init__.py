"""The decision framework, executable: lanes, the lock, evidence records, gates, certification.

* :mod:`~dgr_engine.certification.lane`: a lane's exact identity and its id;
* :mod:`~dgr_engine.certification.lock`: DGR-019, thresholds locked before results;
* :mod:`~dgr_engine.certification.classify`: the evidence class, derived from facts;
* :mod:`~dgr_engine.certification.record`: typed, schema-checked records and their store;
* :mod:`~dgr_engine.certification.gates`: DGR-020, DGR-054, DGR-070;
* :mod:`~dgr_engine.certification.registry`: the certification a worker's lane holds;
* :mod:`~dgr_engine.certification.signing`, ``verify``, ``release``: signed records, checked
  against a lock, and what a release claim needs.

The runners that drive routes to make records (``dgr certify``) are their own room,
:mod:`dgr_engine.certify`; this package never imports them.

``docs/certification.md`` says how they fit.
"""
