"""Parts for the tests and the benchmarks: bounded waits, loopback ports, the digits job's checks, a simulated fleet,
and processes in network namespaces with the faults networks have (:mod:`stalwart.testing.network`).

Nothing in the library imports this package; it sits on top of ``launch``
(whose instrumented worker and local cluster it drives).
"""
