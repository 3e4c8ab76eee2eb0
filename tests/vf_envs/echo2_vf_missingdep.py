"""A verifiers environment whose own dependency is not installed."""

import echo2_no_such_dependency  # noqa: F401
