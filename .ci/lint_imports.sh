#!/usr/bin/env bash
# Run import-linter's contracts (pyproject.toml [tool.importlinter]).
# echo2's subpackages live in top-level folders (the package-dir mapping in pyproject.toml), while
# grimp discovers a package's modules by walking the folder it imports from, so the contracts run
# on a copy of the sources laid out as they are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
lay=$(mktemp -d)
trap 'rm -rf "$lay"' EXIT
mkdir "$lay/echo2"
cp -r echo2/. "$lay/echo2/"
for d in protocol node learner_hub bench; do
    cp -r "$d" "$lay/echo2/$d"
done
find "$lay" -name __pycache__ -prune -exec rm -rf {} +
cd "$lay"
PYTHONPATH="$lay" python -c "import sys; from importlinter.cli import lint_imports_command; sys.argv = ['lint-imports', '$root/pyproject.toml', '--no-cache']; lint_imports_command()"
