"""`optimum-cli export hybrid-npu SRC OUT [export-hybrid's flags]`: our exporter as an Optimum CLI
backend (pip install "hybrid-npu[optimum]"). Optimum finds it through the registration module
this package installs as optimum/commands/register/hybrid_npu.py (export/optimum_register/);
that module imports only this file, and this file imports only optimum's CLI base classes, so
`optimum-cli --help` stays fast. The export itself is export-hybrid's: same flags, same output,
same exit codes (2 for bad input, 1 for a failed parity check).
"""
from __future__ import annotations

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand


class HybridNpuExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="hybrid-npu", help="Export a Qwen3.5-style hybrid (Gated DeltaNet + attention) "
                                                  "checkpoint to state-explicit ONNX for Snapdragon NPU prefill "
                                                  "and CPU decode (hybrid-npu's export-hybrid).")

    @staticmethod
    def parse_args(parser) -> None:
        from hybrid_npu.export.cli import add_arguments

        add_arguments(parser)

    def run(self) -> None:
        from hybrid_npu.export.cli import run

        code = run(self.args, prog="optimum-cli export hybrid-npu")
        if code:
            raise SystemExit(code)


REGISTER_COMMANDS = [(HybridNpuExportCommand, ExportCommand)]
