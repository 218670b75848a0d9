"""Suite-wide settings: hypothesis never fails a test for being slow (CI is a loaded 2-core host;
speed is measured by `kvplane bench`, not by tests)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvplane", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvplane")
