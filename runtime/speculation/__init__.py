"""Speculation's policy: when to speculate and how deep (docs/speculation.md)."""
from .policy import SpecPolicy, Step
from .settings import Settings

__all__ = ["Settings", "SpecPolicy", "Step"]
