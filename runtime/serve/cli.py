"""npu-serve: an OpenAI-compatible local server (chat completions) over one exported model.

    npu-serve [MODEL] [--profile P] [--host 127.0.0.1] [--port 8080] [--api-key KEY]
              [--cors-origin ORIGIN] [--allowed-host NAME] [--max-request-bytes SIZE] [--max-queue N]

Point a client at http://127.0.0.1:8080/v1 with the model name GET /v1/models gives. Needs the
[serve] extra (FastAPI, uvicorn, sse-starlette).
"""
from __future__ import annotations

import ipaddress
import socket
import sys

from hybrid_npu.cli_common import OneLineParser, byte_size, check_threads, human_bytes, report
from hybrid_npu.errors import UserError

from ..drafters import KINDS as DRAFTER_KINDS
from ..model import PREFILL_MODES


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="npu-serve", description="Serve an exported hybrid model through an OpenAI-compatible "
                                                    "API (POST /v1/chat/completions, GET /v1/models, GET /health).")
    p.add_argument("model", nargs="?", help="an export-hybrid output directory (default: the embedded model)")
    p.add_argument("--profile", default="cpu", help="device profile name or TOML path (default: cpu)")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="auto", help="where prompts are prefilled")
    p.add_argument("--memory", type=byte_size, help="memory budget: bytes or e.g. 8G (default: the profile's)")
    p.add_argument("--threads", type=int, help="CPU threads")
    p.add_argument("--no-speculative", action="store_true", help="decode token by token even with a drafter")
    p.add_argument("--drafter", choices=DRAFTER_KINDS,
                   help="which of the export's drafters speculates (default: the export's own choice)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument("--cors-origin", help="allow browser requests from this one origin (default: none)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name clients may use for this server besides its address (repeatable; "
                        "default: IP addresses and localhost only, so a DNS-rebinding web page is refused)")
    p.add_argument("--max-request-bytes", type=byte_size, metavar="SIZE",
                   help="largest request body, e.g. 4M (default: 64 bytes per token of context, at least 1M)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests in progress at once (being prepared, waiting for the model or running); more "
                        "get a 503 with Retry-After (default: 16)")
    p.add_argument("--conversations", type=int, default=4,
                   help="conversations whose state is kept for reuse across requests (default: 4)")
    p.add_argument("--model-name", help="the model id clients use (default: the export directory's name)")
    return p


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(a) -> None:
    if not 0 < a.port < 65536:
        raise UserError(f"--port {a.port}: give a port from 1 to 65535")
    if not 1 <= a.max_queue <= 10000:
        raise UserError(f"--max-queue {a.max_queue}: give 1 to 10000")
    if a.conversations < 1:
        raise UserError(f"--conversations {a.conversations}: give at least 1")
    check_threads(a.threads)


def base_url(host: str, port: int) -> str:
    """The API's address as a client takes it: an IPv6 host in brackets (RFC 3986), http://[::1]:8000/v1."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def _check_port(host: str, port: int) -> None:
    """Say in one line that the address is taken, before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host") from None


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        check_args(a)
        try:
            import uvicorn

            from .server import ChatService, create_app, default_max_request_bytes
        except ImportError as e:
            raise UserError(f"npu-serve needs the serve extra ({e.name} is missing): "
                            "pip install 'hybrid-npu[serve]'") from None
        from ..model_args import open_model

        if not _loopback(a.host) and not a.api_key:
            print(f"npu-serve: warning: listening on {a.host} without --api-key: anyone who can reach this machine "
                  "can use the model", file=sys.stderr)
        _check_port(a.host, a.port)
        model = open_model(a.model, a)
        service = ChatService(model, a.model_name or model.path.name, a.conversations,
                              False if a.no_speculative else None, max_queue=a.max_queue)
        limit = a.max_request_bytes or default_max_request_bytes(model.memory.max_context)
        app = create_app(service, a.api_key, a.cors_origin, a.host, a.allowed_host, limit)
        drafter = "on" if model.drafter is not None and not a.no_speculative else "off"
        print(f"npu-serve: {model.path} as {service.model_id!r} on {base_url(a.host, a.port)} (profile "
              f"{model.profile.name}, speculative {drafter}, context {model.memory.max_context} tokens, requests up "
              f"to {human_bytes(limit)}, {a.max_queue} at once); "
              "Ctrl-C stops", file=sys.stderr, flush=True)
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False)
        return 0
    except UserError as e:
        return report("npu-serve", e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
