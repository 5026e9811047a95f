.PHONY: run test lint bench embedded-status embedded-stop

# Run the system: web + worker + beat + Flower, on local or embedded PostgreSQL/Redis.
run:
	bash scripts/run.sh

# Run every check: ruff, mypy, pytest (with real workers).
test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/mypy .

# The private embedded PostgreSQL/Redis under .embedded/ (only used when nothing else is there).
embedded-status:
	.venv/bin/python scripts/services.py status

embedded-stop:
	.venv/bin/python scripts/services.py stop

# Benchmarks (private DB reservations_bench, Redis DB 5): prints a table, writes bench/results/.
bench:
	.venv/bin/python bench/run.py $(ARGS)
