"""``python -m pytest_msrun.perfetto job.trace.json``: open a trace in the Perfetto UI.

As Perfetto's own ``open_trace_in_ui`` does it: serve the file once from ``127.0.0.1:9001`` (the
port the UI is allowed to fetch from) to ``https://ui.perfetto.dev`` and open the browser at
``https://ui.perfetto.dev/#!/?url=http://127.0.0.1:9001/<name>``. The file never leaves this
machine; the server ends once the UI has fetched it (or after ``--wait`` seconds).
"""

from __future__ import annotations

import argparse
import http.server
import os
import sys
import threading
import urllib.parse
import webbrowser

PORT = 9001  # the only local port ui.perfetto.dev's content security policy lets it fetch from
ORIGIN = "https://ui.perfetto.dev"


def ui_url(name: str, port: int = PORT) -> str:
    return f"{ORIGIN}/#!/?url=http://127.0.0.1:{port}/{urllib.parse.quote(name)}"


def serve(path: str, port: int = PORT, wait: float = 60.0, open_browser: bool = True) -> bool:
    """Serve ``path`` until it has been fetched once (True) or ``wait`` seconds passed (False)."""
    name = os.path.basename(path)
    with open(path, "rb") as fh:
        body = fh.read()
    fetched = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.lstrip("/") != urllib.parse.quote(name):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Access-Control-Allow-Origin", ORIGIN)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            fetched.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = ui_url(name, port)
        print(f"serving {path} on http://127.0.0.1:{port}/ for {url}", flush=True)
        if open_browser:
            webbrowser.open(url)
        return fetched.wait(wait)
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytest_msrun.perfetto", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a trace file written by MSRUN_TRACE / --trace / --msrun-trace")
    ap.add_argument("--port", type=int, default=PORT, help="local port (the Perfetto UI allows 9001)")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the UI to fetch it")
    ap.add_argument("--no-browser", action="store_true", help="print the URL, do not open a browser")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.trace):
        ap.error(f"argument trace: {args.trace} is not a file")
    ok = serve(args.trace, args.port, args.wait, not args.no_browser)
    if not ok:
        print(f"the Perfetto UI did not fetch the trace within {args.wait:g} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
