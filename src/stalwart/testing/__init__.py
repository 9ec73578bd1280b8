"""Parts for the tests and the benchmarks: bounded waits, loopback ports, the digits job's checks, a simulated fleet.

Nothing in the library imports this package; it sits on top of ``launch``
(whose instrumented worker and local cluster it drives).
"""
