from hypothesis import HealthCheck, settings

# derandomized: the same examples on every run (and in CI)
settings.register_profile(
    "default", deadline=None, derandomize=True, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("default")
