"""Installed as optimum/commands/register/hybrid_npu.py: optimum-cli imports every module of that
namespace and registers its REGISTER_COMMANDS (here: `optimum-cli export hybrid-npu`)."""
from hybrid_npu.export.optimum_plugin import REGISTER_COMMANDS  # noqa: F401
