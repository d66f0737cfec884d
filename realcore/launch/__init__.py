"""Command-line entry: hydra composition, schedulers, the launcher's watch loop."""
