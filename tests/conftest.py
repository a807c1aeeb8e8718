import os
import sys

from hypothesis import HealthCheck, settings

# tests.support is imported by subprocess programs too: make the repo root importable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

# derandomized: the same examples on every run (and in CI)
settings.register_profile(
    "default", deadline=None, derandomize=True, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("default")
