"""Tests of the synthetic tasks."""
