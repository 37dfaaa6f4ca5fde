"""``infinity bench``: what can this machine train, and how fast (see :mod:`.runner`)."""

from .runner import BenchConfig, report, run_bench, save

__all__ = ["BenchConfig", "report", "run_bench", "save"]
