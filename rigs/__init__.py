"""The rigs the tests and the benchmarks stage their runs on: real HAProxy masters and
backends on loopback, the daemon as a subprocess, network namespaces, Ray Serve clusters,
load clients and staged incidents. Not part of the product: shared by tests/ and bench/, and
what only the tests use stays in tests/support/."""
