"""Suite-wide test settings."""

from hypothesis import settings

# Property tests assert behaviour, not speed: a loaded 2-core CI machine must not turn a slow
# example into a failure (Hypothesis's default deadline is 200 ms per example).
settings.register_profile("specpilot", deadline=None, print_blob=True)
settings.load_profile("specpilot")
