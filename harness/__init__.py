"""What the tests and the benchmarks share, so that neither imports from the other: the
independent dense reference (`harness.reference`) and the local deployment's arguments
(`harness.local`); and `make test`'s runner (`harness.suite`). Not part of any distribution:
used from a repository checkout."""
