"""``qaccel push`` without the internet: dry run, refusals, and a real upload to a local Hub stand-in.

The stand-in is an ``http.server`` on 127.0.0.1 that implements the endpoints huggingface_hub 2.4's
``whoami``, ``create_repo``, ``create_branch`` and ``upload_folder`` call (``/api/whoami-v2``,
``/api/repos/create``, ``/api/models/{repo}/branch/{b}``, ``/api/validate-yaml``,
``/api/models/{repo}/preupload/{rev}``, ``/api/models/{repo}/commit/{rev}``) and records every
request. It answers ``regular`` to the preupload question, so file contents arrive base64-encoded
inside the commit: the test compares them byte for byte with the folder. The CLI runs as a real
subprocess with ``HF_HOME`` in a temporary folder, so no token stored on the machine is used.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
from safetensors.torch import save_file

from qaccel.checkpoint import build_run_state
from qaccel.hub.card import build_model_card
from qaccel.hub.push import PushError, push_folder

TOKEN = "hf_qaccelTestToken0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[2]


class _HubStandIn(BaseHTTPRequestHandler):
    """Just enough of the Hub API for create_repo + upload_folder; records what arrives."""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self, body: bytes) -> dict:
        entry = {"method": self.command, "path": unquote(urlparse(self.path).path), "auth": self.headers.get("authorization"), "body": body}
        self.server.requests.append(entry)
        return entry

    def do_GET(self):  # noqa: N802 - http.server naming
        entry = self._record(b"")
        if entry["path"] == "/api/whoami-v2":
            if entry["auth"] != f"Bearer {TOKEN}":
                return self._reply(401, {"error": "Invalid credentials in Authorization header"})
            return self._reply(200, {"type": "user", "name": "tester", "auth": {"type": "access_token"}})
        return self._reply(404, {"error": f"stand-in: no GET {entry['path']}"})

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        entry = self._record(body)
        path = entry["path"]
        if entry["auth"] != f"Bearer {TOKEN}":
            return self._reply(401, {"error": "Invalid credentials"})
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        if path == "/api/repos/create":
            request = json.loads(body)
            return self._reply(200, {"url": f"{host}/{request['organization']}/{request['name']}"})
        if path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        parts = path.split("/")  # ['', 'api', 'models', org, name, kind, revision]
        if len(parts) == 7 and parts[:3] == ["", "api", "models"]:
            kind = parts[5]
            if kind == "preupload":
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
            if kind == "commit":
                return self._reply(200, {"commitUrl": f"{host}/{parts[3]}/{parts[4]}/commit/{'a' * 40}", "commitOid": "a" * 40})
            if kind == "branch":
                return self._reply(200, {})
        return self._reply(404, {"error": f"stand-in: no POST {path}"})


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubStandIn)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _endpoint(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture
def export_folder(tmp_path):
    """A small folder shaped like an export: card, weights, config, sidecar."""
    folder = tmp_path / "export"
    folder.mkdir()
    state = build_run_state(
        method="qsdp", method_config={"weight_bits": 4, "grad_bits": 4}, recipe=None, task="causal-lm", step=7,
        world_size=2, wire_bytes_total=1000, baseline_wire_bytes_total=8000, metrics={"eval_loss": 2.5}, dataset="wikitext",
    )  # fmt: skip
    build_model_card(state, model_name="org/tiny").save(str(folder / "README.md"))
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "qaccel_config.json").write_text(json.dumps({"qaccel_method": "qsdp"}))
    return folder


def _cli_env(tmp_path, endpoint: str, token: str | None, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT=endpoint, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    if token is not None:
        env["HF_TOKEN"] = token
    env.update(extra)
    return env


def _run_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qaccel.cli", "-v", "push", *args], env=env, capture_output=True, text=True, timeout=180)


def test_dry_run_prints_the_plan_and_sends_nothing(hub, export_folder, tmp_path):
    proc = _run_cli([str(export_folder), "--repo_id", "org/tiny", "--dry_run"], _cli_env(tmp_path, _endpoint(hub), TOKEN))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["push"]
    expected = {p.name: p.stat().st_size for p in export_folder.iterdir()}
    assert {f["path"]: f["size"] for f in plan["files"]} == expected
    assert plan["total_bytes"] == sum(expected.values())
    assert plan["dry_run"] is True and plan["repo_id"] == "org/tiny" and plan["revision"] == "main"
    assert plan["card"]["library_name"] == "transformers" and "qsdp" in plan["card"]["tags"]
    assert hub.requests == []
    assert TOKEN not in proc.stdout + proc.stderr


def test_offline_mode_is_refused_before_any_request(hub, export_folder, tmp_path):
    env = _cli_env(tmp_path, _endpoint(hub), TOKEN, HF_HUB_OFFLINE="1")
    proc = _run_cli([str(export_folder), "--repo_id", "org/tiny"], env)
    assert proc.returncode == 1
    assert "offline mode" in proc.stderr and "nothing was sent" in proc.stderr
    assert proc.stderr.count("qaccel push:") == 1 and proc.stdout == ""
    assert hub.requests == []


def test_missing_token_is_refused_before_any_request(hub, export_folder, tmp_path):
    proc = _run_cli([str(export_folder), "--repo_id", "org/tiny"], _cli_env(tmp_path, _endpoint(hub), None))
    assert proc.returncode == 1
    assert "no Hugging Face token" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert proc.stderr.count("qaccel push:") == 1
    assert hub.requests == []


def test_unreachable_endpoint_is_one_clear_error(export_folder, tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    proc = _run_cli([str(export_folder), "--repo_id", "org/tiny"], _cli_env(tmp_path, endpoint, TOKEN))
    assert proc.returncode == 1
    assert f"cannot reach {endpoint}" in proc.stderr and "nothing was sent" in proc.stderr
    assert proc.stderr.count("qaccel push:") == 1
    assert TOKEN not in proc.stdout + proc.stderr


def test_rejected_token_stops_before_creating_the_repo(hub, export_folder):
    with pytest.raises(PushError, match="rejected the token"):
        push_folder(export_folder, "org/tiny", token="hf_wrong", endpoint=_endpoint(hub))
    assert [r["path"] for r in hub.requests] == ["/api/whoami-v2"]


def test_upload_sends_every_file_in_one_commit(hub, export_folder, tmp_path):
    args = [str(export_folder), "--repo_id", "org/tiny", "--private", "--revision", "v1", "--commit_message", "first"]
    proc = _run_cli(args, _cli_env(tmp_path, _endpoint(hub), TOKEN))
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    result = json.loads(proc.stdout)["push"]
    assert result["commit_oid"] == "a" * 40 and result["url"].endswith("/org/tiny")

    paths = [(r["method"], r["path"]) for r in hub.requests]
    assert paths[0] == ("GET", "/api/whoami-v2")
    assert ("POST", "/api/repos/create") in paths and ("POST", "/api/models/org/tiny/branch/v1") in paths
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.requests)
    create = json.loads(next(r["body"] for r in hub.requests if r["path"] == "/api/repos/create"))
    assert (create["organization"], create["name"], create.get("visibility")) == ("org", "tiny", "private")

    commits = [r for r in hub.requests if r["path"].startswith("/api/models/org/tiny/commit/")]
    assert [c["path"] for c in commits] == ["/api/models/org/tiny/commit/v1"]
    lines = [json.loads(line) for line in commits[0]["body"].decode().splitlines()]
    assert lines[0] == {"key": "header", "value": {"summary": "first", "description": ""}}
    received = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines[1:] if line["key"] == "file"}
    assert received == {p.name: p.read_bytes() for p in export_folder.iterdir()}


def test_plan_refuses_bad_input(export_folder, tmp_path):
    with pytest.raises(ValueError, match="ORG/NAME"):
        push_folder(export_folder, "tiny", dry_run=True)
    with pytest.raises(ValueError, match="repo_id='org/bad name'"):
        push_folder(export_folder, "org/bad name", dry_run=True)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        push_folder(tmp_path / "missing", "org/tiny", dry_run=True)
    (export_folder / "README.md").unlink()
    with pytest.raises(ValueError, match="no README.md"):
        push_folder(export_folder, "org/tiny", dry_run=True)
