.PHONY: run test test-full lint unit drills lock bench bench-confirms flash-sale soak chaos sentinel-drill pg-failover-drill rabbitmq-cluster-drill embedded-status embedded-stop

# Run the system: web + worker + beat + Flower, on local or embedded PostgreSQL/Redis.
run:
	bash scripts/run.sh

# Run every check: ruff, mypy, pytest (with real workers); leaves out the drills (CI runs them).
# The suite's phases are nox sessions (noxfile.py): `.venv/bin/nox -l` lists them.
test:
	bash scripts/test.sh

# The same plus the TLS and PgBouncer sessions and the drills, as CI runs it (nox -s full).
test-full:
	RESERVATIONS_DRILLS=1 bash scripts/test.sh

# ruff, ruff format --check and mypy.
lint:
	.venv/bin/nox -s lint

# The unit tests in a random order: make unit ARGS="--randomly-seed=N" replays one.
unit:
	.venv/bin/nox -s unit -- $(ARGS)

# Every drill, one after another (the last phases of make test-full and CI).
drills:
	.venv/bin/nox -s drills -- $(ARGS)

# Chaos drills with real services (minutes; part of make test-full and CI): a lost node at
# the default recovery settings, a private Redis restarted mid-burst, every database connection
# terminated, a partitioned worker.
chaos:
	.venv/bin/nox -s chaos -- $(ARGS)

# The Sentinel failover drill (about a minute; after the chaos drills in make test-full): its
# own master, replica and three sentinels on free ports, the master killed mid-drain.
sentinel-drill:
	.venv/bin/nox -s sentinel -- $(ARGS)

# The PostgreSQL failover drill (about a minute; after the Sentinel drill in make test-full):
# its own primary and streaming standby on free ports, the primary stopped hard mid-drain and
# the standby promoted, with synchronous and asynchronous replication.
pg-failover-drill:
	.venv/bin/nox -s pg-failover -- $(ARGS)

# The RabbitMQ cluster drill (about a minute; the last drill of make test-full):
# three RabbitMQ nodes of its own in one cluster, the release queue's leader killed mid-drain,
# with quorum queues and then with classic ones.
rabbitmq-cluster-drill:
	.venv/bin/nox -s rabbitmq-cluster -- $(ARGS)

# Recompile requirements*.txt (hashes) from requirements*.in: make lock ARGS="--upgrade-package celery"
lock:
	bash scripts/lock.sh $(ARGS)

# The private embedded PostgreSQL/Redis under .embedded/ (only used when nothing else is there).
embedded-status:
	.venv/bin/python scripts/backing_servers.py status

embedded-stop:
	.venv/bin/python scripts/backing_servers.py stop

# Benchmarks (private DB reservations_bench, Redis DB 5): prints a table, writes reports/bench/.
bench:
	.venv/bin/python bench/run.py $(ARGS)

# Publisher confirms on RabbitMQ (under two minutes): one sweep batch through the confirmed fan-out
# and the old unconfirmed one, side by side, on the machine's RabbitMQ (vhosts of its own,
# classic and quorum queues) and on a three-node cluster of its own; ARGS="--quick" to smoke-test.
bench-confirms:
	.venv/bin/python bench/publish_confirms.py $(ARGS)

# The flash-sale drill (own DB reservations_drill, Redis DB 6): make flash-sale MODE=default|single|batch
flash-sale:
	.venv/bin/python bench/flash_sale.py $(MODE) $(ARGS)

# The soak drill (own DB reservations_drill, Redis DB 6): make soak MINUTES=60 OUT=reports/soak
soak:
	.venv/bin/python bench/soak.py --minutes $(or $(MINUTES),60) --out $(or $(OUT),reports/soak) $(ARGS)
