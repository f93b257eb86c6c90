# mlxcel developer tasks. `just --list` shows them; CI and the README need no `just`
# (.ci/run runs the same commands as `check`: after the install, ruff and the statechart check, then the
# tests with mypy beside them at the lowest priority).

venv := ".venv/bin/"

# Lint, type-check and run the fast tests: the loop while you work
default: lint test-fast

# Install mlxcel and its development tools into .venv
install:
    python3 -m venv .venv
    {{venv}}pip install --quiet -e '.[dev]'

# Run the whole test suite (slow tests included, as in CI)
test *args: install
    {{venv}}pytest {{args}}

# Run only the fast tests
test-fast *args:
    {{venv}}pytest -m "not slow" {{args}}

# Lint and type-check (ruff everywhere, mypy strict on mlxcel/policy)
lint:
    {{venv}}ruff check mlxcel tests benchmarks
    {{venv}}mypy

# What CI runs: the README's test command, then lint, type-check and the statechart check
check: test lint docs

# Regenerate the statechart diagram and its docs block from the DSL
statechart:
    {{venv}}mlxcel statechart --write

# Check the generated docs are fresh (what CI does)
docs:
    {{venv}}mlxcel statechart --check

# Serve the bundled default model on 127.0.0.1:8080
serve *args:
    {{venv}}mlxcel serve {{args}}

# Screenshots of the page in each policy state, into docs/page (needs chromium and chromium-driver)
page-shots:
    {{venv}}python -m mlxcel.testing.page_shots docs/page
