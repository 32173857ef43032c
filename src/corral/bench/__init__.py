"""``corral bench``: benchmark scenarios with JSON results and side-by-side baselines.

The scenarios live in :mod:`corral.bench.scenarios`, the CLI in :mod:`corral.bench.cli`,
the Docker baseline in :mod:`corral.bench.docker`, percentiles in :mod:`corral.bench.stats`.
"""

__all__: list[str] = []
