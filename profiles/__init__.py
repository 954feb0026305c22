"""Device profiles (TOML): NPU options, chunk sizes, dispatch thresholds. Filled in by the NPU-path issue."""
from .loader import Profile, builtin_profiles, load_profile

__all__ = ["Profile", "builtin_profiles", "load_profile"]
