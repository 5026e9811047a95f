.PHONY: run test lint bench

# Run the system: web + worker + beat + Flower, on local or embedded PostgreSQL/Redis.
run:
	bash scripts/run.sh

# Run every check: ruff, mypy, pytest (with real workers).
test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/mypy .
