"""Built-in datasets and rewards; importing this package registers them."""

from realcore.data import datasets, math_verify, preferences  # noqa: F401  (registration side effects)
