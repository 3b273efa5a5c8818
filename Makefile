# The two commands of the README. Both build (or reuse) the cached venv first.
#   make run    set up and run the main job (the embedded tiny default, on CPU)
#   make test   set up and run lint and the test suite (make test ARGS=tests/unit: seconds)
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
export PYTHONPATH := $(CURDIR)
ARGS ?=

.PHONY: run test lint venv tools-example vision-example
venv:
	@tools/setup_env.sh >/dev/null

run:
	@V=$$(tools/setup_env.sh) && $$V/bin/python -m rl.train $(ARGS)

# The tool-use example (docs/examples.md, "Tool use"): its data and tokenizer, then the job.
tools-example:
	@V=$$(tools/setup_env.sh) && $$V/bin/python tools/make_tool_task.py --out outputs/tool_task \
		&& $$V/bin/python -m rl.train experiment=tiny_tools $(ARGS)

# The vision-language example (docs/examples.md, "A vision-language policy"): its model
# and images, then the job.
vision-example:
	@V=$$(tools/setup_env.sh) && $$V/bin/python tools/make_tiny_vision.py \
		--model-out models/tiny-vl --data-out data/shapes \
		&& $$V/bin/python -m rl.train experiment=tiny_vision $(ARGS)

# ruff; the import layers (.importlinter); types (mypy, [tool.mypy] in pyproject.toml).
LINT = $$V/bin/ruff check . && $$V/bin/ruff format --check . \
	&& $$V/bin/lint-imports --no-cache && $$V/bin/mypy

lint:
	@V=$$(tools/setup_env.sh) && $(LINT)

test:
	@V=$$(tools/setup_env.sh) && $(LINT) && $$V/bin/python -m pytest $(ARGS)
