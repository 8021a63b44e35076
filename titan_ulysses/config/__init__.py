"""Configuration: dataclasses mirroring the TOML sections, loading, overrides and validation."""
