"""The coding-agent CLIs as their users run them, against a fermoe daemon: pinned releases
from npm, each run non-interactively with a scratch home, telemetry and updates off, and a
short system prompt where the client takes one (so a run takes seconds, not minutes).

`python3 -m tests.agents.clis install` installs them (.ci/run does, where Node is present)
into CLI_PREFIX; the tests find them there.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PINS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0",
        "opencode": "opencode-ai@1.18.33"}
CLI_PREFIX = Path(os.environ.get("FERMOE_AGENT_CLIS", Path.home() / ".cache" / "fermoe" / "agent-clis"))
SYSTEM = "Answer briefly."
RUN_TIMEOUT_S = 600           # a cold 7k-token Codex prompt on a loaded 2-core machine, with margin
PYDOC_TOOL = Path(__file__).with_name("pydoc_tool.ts")


def binary(name: str) -> Path | None:
    path = CLI_PREFIX / "node_modules" / ".bin" / name
    return path if path.exists() else None


def install() -> None:
    """npm install of the pinned releases into CLI_PREFIX (a no-op where they are there)."""
    CLI_PREFIX.mkdir(parents=True, exist_ok=True)
    wanted = {spec.rpartition("@")[0]: spec.rpartition("@")[2] for spec in PINS.values()}
    if all(_installed(package) == version for package, version in wanted.items()):
        return
    subprocess.run(["npm", "install", "--prefix", str(CLI_PREFIX), "--no-audit", "--no-fund", "--no-package-lock",
                    *PINS.values()], check=True)


def _installed(package: str) -> str | None:
    manifest = CLI_PREFIX / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text()).get("version") if manifest.exists() else None


@dataclass
class Run:
    """One CLI invocation: its exit status and output."""
    returncode: int
    stdout: str
    stderr: str

    def json_lines(self) -> list[dict]:
        """The output as JSON lines (Claude Code's stream-json, Codex's and opencode's --json)."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]


class Client:
    """A CLI with its scratch home and configuration, pointed at `url` (the daemon, or a
    recorder in front of it)."""
    name: str

    def __init__(self, url: str, home: Path):
        self.url, self.home = url.rstrip("/"), home
        self.workdir = home / "work"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1",
                    "LANG": "C.UTF-8"}
        self.configure()

    def configure(self) -> None:
        pass

    def command(self, prompt: str, follow_up: bool) -> list[str]:
        raise NotImplementedError

    def run(self, prompt: str, follow_up: bool = False) -> Run:
        """The prompt as a new session, or (follow_up) as the next turn of the last one."""
        p = subprocess.run([str(binary(self.name)), *self.command(prompt, follow_up)], env=self.env,
                           cwd=self.workdir, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
        return Run(p.returncode, p.stdout, p.stderr)


class ClaudeCode(Client):
    name = "claude"

    def configure(self):
        self.env.update(ANTHROPIC_BASE_URL=self.url, ANTHROPIC_API_KEY="unused", DISABLE_TELEMETRY="1",
                        DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1",
                        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")

    def command(self, prompt, follow_up):
        return ["-p", prompt, "--output-format", "stream-json", "--verbose", "--model", "tiny",
                "--system-prompt", SYSTEM, "--tools", "Read,Agent", *(["--continue"] if follow_up else [])]


class Codex(Client):
    name = "codex"

    def configure(self):
        codex_home = self.home / "codex"
        codex_home.mkdir()
        (self.home / "instructions.md").write_text(SYSTEM + "\n")
        (codex_home / "config.toml").write_text(
            'model = "tiny"\nmodel_provider = "fermoe"\n'
            f'model_instructions_file = "{self.home / "instructions.md"}"\n'
            'check_for_update_on_startup = false\n\n'
            '[analytics]\nenabled = false\n\n'
            '[model_providers.fermoe]\nname = "fermoe"\n'
            f'base_url = "{self.url}/v1"\nwire_api = "responses"\n')
        self.env.update(CODEX_HOME=str(codex_home))

    def command(self, prompt, follow_up):
        resume = ["resume", "--last"] if follow_up else []
        return ["exec", *resume, "--skip-git-repo-check", "--json", prompt]


class OpenCode(Client):
    """opencode with an OpenAI-compatible provider and a custom tool, `pydoc` (pydoc_tool.ts):
    opencode loads the tool through its plugin package, which it installs from npm beside it."""
    name = "opencode"
    # the built-in tools but for `skill`, which cannot be turned off, leave the stage to pydoc
    TOOLS_OFF = ("bash", "edit", "write", "read", "grep", "glob", "list", "patch", "todowrite", "todoread",
                 "webfetch", "websearch", "task")

    def configure(self):
        config = {"$schema": "https://opencode.ai/config.json", "model": "fermoe/tiny", "small_model": "fermoe/tiny",
                  "share": "disabled", "autoupdate": False,
                  "provider": {"fermoe": {"npm": "@ai-sdk/openai-compatible", "name": "fermoe",
                                          "options": {"baseURL": f"{self.url}/v1", "apiKey": "unused"},
                                          "models": {"tiny": {"name": "tiny"}}}},
                  # our system prompt; no title request
                  "agent": {"build": {"prompt": SYSTEM}, "title": {"disable": True}},
                  "tools": {name: False for name in self.TOOLS_OFF}}
        (self.workdir / "opencode.json").write_text(json.dumps(config, indent=1))
        tools = self.workdir / ".opencode" / "tool"
        tools.mkdir(parents=True)
        shutil.copy(PYDOC_TOOL, tools / "pydoc.ts")
        self.env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_SHARE="1",
                        OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_FERMOE_PYTHON=sys.executable)

    def command(self, prompt, follow_up):
        return ["run", "--format", "json", *(["--continue"] if follow_up else []), *prompt.split()]


CLIENTS = {c.name: c for c in (ClaudeCode, Codex, OpenCode)}


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python3 -m tests.agents.clis install")
    install()
