"""Tests of bapo_jax.algorithms."""
