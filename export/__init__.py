"""Hugging Face checkpoint → state-explicit, static-shape ONNX step graphs (docs/architecture.md)."""
