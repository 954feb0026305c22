"""npu-serve: an OpenAI-compatible local server (command line, application, request checks, held contexts)."""
