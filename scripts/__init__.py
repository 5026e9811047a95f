"""The project's scripts (run as files by the Makefile and scripts/test.sh); a package so
that the tests and benchmarks import the ones they share: scripts/rabbitmq_cluster.py."""
