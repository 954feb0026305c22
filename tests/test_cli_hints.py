"""What the chat front end tells a user: a Hugging Face checkpoint given where an export belongs gets
an export command that works as given, and the context count is the same number wherever it shows."""
import shlex

import fixtures
import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime.chat.repl import status_line
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling


def test_a_checkpoint_given_to_chat_suggests_an_export_beside_it_that_the_exporter_accepts(tmp_path, capsys):
    from hybrid_npu.runtime.chat.cli import main

    ckpt = tmp_path / "ckpt" / "tiny-qwen35"
    fixtures.write_text_checkpoint(ckpt, seed=1, tie=True)
    capsys.readouterr()  # the checkpoint writer's own progress
    assert main([str(ckpt), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    command = err.split("export-hybrid ", 1)[1].split(", then")[0]
    src, out = shlex.split(command)
    assert src == str(ckpt)
    export(src, out, chunk=8)  # the exporter refuses an output inside its source; this one it takes
    assert hybrid_npu.load_engine(out).memory_report()["context_tokens"] == 0


def test_not_a_checkpoint_either_names_the_export_command(tmp_path):
    with pytest.raises(UserError, match="export-hybrid CHECKPOINT"):
        hybrid_npu.load_engine(tmp_path)


def test_the_status_line_stats_and_the_conversation_count_the_context_alike(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    conv = Conversation(engine)
    reply = conv.reply("def f(x):", Sampling(max_new_tokens=6, temperature=0))
    held = len(engine.context_ids())  # every token of the conversation, the reply's last included
    assert engine.memory_report()["context_tokens"] == held == engine.last_stats["context_tokens"]
    assert f"context {held}/" in status_line(reply, conv, width=400)
