"""npu-chat: the chat front end (template, conversation, REPL, tool calls) over a loaded model."""
