"""Device profiles (TOML): NPU options, chunk sizes, dispatch thresholds. Filled in by the NPU-path issue."""
