"""The NPU side of an export: cutting the model into parts, their QDQ quantisation, compiling them on the
QNN HTP (a child-process check, --check-npu, QNN context binaries)."""
