"""Parts for the tests and the benchmarks: bounded waits, loopback ports, the digits job's checks, a simulated fleet,
processes in network namespaces with the faults networks have (:mod:`stalwart.testing.network`), and torchtitan on
CPU: the torchrun entry point with its CPU shims (:mod:`stalwart.testing.torchtitan_cpu`), a generated corpus and
tokenizer, an audit of the batches trained and a launch to SIGKILL (:mod:`stalwart.testing.torchrun`).

Nothing in the library imports this package; it sits on top of ``launch``
(whose instrumented worker and local cluster it drives).
"""
