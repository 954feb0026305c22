"""The model's math twice: a plain numpy reference (the truth) and the ONNX formulation the
exporter emits, side by side in one file per kernel. tests/test_kernels.py holds them together
and both against transformers."""
