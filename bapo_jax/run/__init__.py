"""Runs: a whole RL run's config tree, building it, the dry run and the experiments' CLI."""
