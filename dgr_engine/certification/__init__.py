"""The decision framework, executable: lanes, the lock, evidence records, gates, certification.

* :mod:`~dgr_engine.certification.lane`: a lane's exact identity and its id;
* :mod:`~dgr_engine.certification.lock`: DGR-019, thresholds locked before results;
* :mod:`~dgr_engine.certification.classify`: the evidence class, derived from facts;
* :mod:`~dgr_engine.certification.record`: typed, schema-checked records and their store;
* :mod:`~dgr_engine.certification.gates`: DGR-020, DGR-054, DGR-070;
* :mod:`~dgr_engine.certification.registry`: the certification a worker's lane holds;
* :mod:`~dgr_engine.certification.certify`: the scenarios ``dgr certify`` runs.

``docs/certification.md`` says how they fit.
"""
