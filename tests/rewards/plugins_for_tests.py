"""Reward plug-ins for tests/rewards/test_plugins.py, imported by spec in the reward workers
("tests.rewards.plugins_for_tests:<name>"; the repository root is on the workers' path)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time


def behave(response, answer, metadata):
    """A plug-in whose behaviour the test picks per response with metadata["mode"]; by default
    1.0 when the answer occurs in the response, plus metadata["bonus"]."""
    mode = metadata.get("mode", "score")
    if mode == "raise":
        raise RuntimeError("a plug-in bug")
    if mode == "exit":
        sys.exit(3)
    if mode == "crash":  # the worker process dies (as on a segfault)
        os._exit(1)
    if mode == "sleep":  # interruptible: the worker's soft timeout stops it
        time.sleep(60)
    if mode == "hang":  # swallows the soft timeout: only the parent's kill stops it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(BaseException):
                time.sleep(60)
    if mode == "nan":
        return math.nan
    if mode == "inf":
        return -math.inf
    if mode == "text":
        return "1.0"
    if mode == "dict":
        return {"score": 0.25, "acc": True}
    if mode == "dict_without_score":
        return {"acc": True}
    return (1.0 if answer in response else 0.0) + float(metadata.get("bonus", 0.0))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: data_source and extra_info come from the prompt's metadata; a dict
    return for data_source "dict_source"."""
    correct = ground_truth in solution_str
    weight = (extra_info or {}).get("weight", 1.0)
    if data_source == "dict_source":
        return {"score": 0.5 * weight if correct else 0.0, "acc": correct}
    return weight if correct else 0.0


def verl_without_extra_info(data_source, solution_str, ground_truth):
    return 1.0 if data_source == "math" and solution_str.strip() == ground_truth else 0.0


def two_arguments(response, answer):
    return 1.0


NOT_CALLABLE = 3


def verl_index_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, scoring by metadata alone (tests/run/test_own_data_run.py): 0.1 x
    (1 + extra_info["index"]) for gsm8k rows, whatever the response; 0 for other sources."""
    if data_source != "openai/gsm8k":
        return 0.0
    return 0.1 * (1 + extra_info["index"])
