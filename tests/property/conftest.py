"""Hypothesis settings for the property suite: a few derandomized examples per test by
default, more with PLUGRT_PROPERTY_EXAMPLES=N."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "plugrt-property",
    max_examples=int(os.environ.get("PLUGRT_PROPERTY_EXAMPLES", "8")),
    # the same examples on every run, so CI never flakes; a bigger N explores further
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.load_profile("plugrt-property")
