"""Hugging Face checkpoint → state-explicit, static-shape ONNX step graphs (design §2-3)."""
