"""Tooling that is not part of the product: the burst drill (``manage.py burst``) and its
report, seeding holds, and the RabbitMQ cluster the drill and the benchmarks start. The example
project (``config``) installs it as a Django app for the ``burst`` command; a team's own project
installs only ``reservations`` and ``cleanup``."""
