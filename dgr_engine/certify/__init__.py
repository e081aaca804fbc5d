"""The certification runners: what ``dgr certify`` drives to make evidence records.

* :mod:`~dgr_engine.certify.scenarios`: each scenario of a lane, run over real workers;
* :mod:`~dgr_engine.certify.runner`: a lane's scenarios in order, the record made and signed.

They route sessions and spawn workers, so they sit apart from the pure decision framework in
:mod:`dgr_engine.certification` (lanes, the lock, records, gates, signing), which the worker
reads and which never imports this room (a test keeps the rule).
"""
