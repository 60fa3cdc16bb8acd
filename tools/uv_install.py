#!/usr/bin/env python3
"""`uv pip install ARGS` into this interpreter's environment, with pip's configuration handed over (what
tools/install.sh runs when uv is available).

uv reads none of pip's configuration, yet a machine's pip.conf or PIP_* variables may be what makes an install work
there: a local wheel directory (find-links), a mirror (index-url), extra indexes, constraints, a company CA
certificate. This reads pip's effective configuration (`pip config list`: the files merged, then the environment on
top, as pip applies them) and passes each setting to uv as the matching option, so both installers see the same
packages. The resolution is pip's too: the best version over every index (`--index-strategy unsafe-best-match`),
where uv's default would stop at the first index that has the package.

    python tools/uv_install.py -e ".[pinned,lab,test]"   what install.sh runs
    python tools/uv_install.py --print               show the uv command instead of running it
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

# pip option -> uv option (each value of a multi-valued pip option becomes one uv option)
OPTIONS = {
    "index-url": "--default-index",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraints",
    "trusted-host": "--allow-insecure-host",
}
SECTIONS = ("global", "install", ":env:")     # later overrides earlier, as pip applies them for `pip install`
LINE = re.compile(r"^(?P<section>[^.]*|:env:)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's effective settings for `pip install`, e.g. {'find-links': '/opt/wheels'}."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m and m["section"] in SECTIONS:
            rank = SECTIONS.index(m["section"])
            if m["key"] not in found or rank >= found[m["key"]][0]:
                found[m["key"]] = (rank, m["value"])
    return {k: v for k, (_, v) in found.items()}


def _exists(location: str) -> bool:
    """False for a local path or file:// URL that is not there (pip warns and goes on; uv would stop)."""
    if "://" not in location:
        return Path(location).exists()
    url = urlparse(location)
    return url.scheme != "file" or Path(unquote(url.path)).exists()


def uv_options(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(uv options, environment additions) equivalent to pip's settings."""
    args: list[str] = []
    for key, option in OPTIONS.items():
        for value in config.get(key, "").split():
            if key == "trusted-host" or _exists(value):
                args += [option, value]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    env = {}
    if config.get("cert") and "SSL_CERT_FILE" not in os.environ:
        env["SSL_CERT_FILE"] = config["cert"]   # uv takes a CA bundle from here
    return args, env


def main(argv: list[str]) -> int:
    show = "--print" in argv
    argv = [a for a in argv if a != "--print"]
    uv = Path(sys.executable).with_name("uv")
    options, env = uv_options(pip_config())
    # No --compile-bytecode: uv leaves each .pyc to the first import that needs it, and the Makefile lets that
    # import store it (it unexports PYTHONDONTWRITEBYTECODE, which some machines set, this course's CI among them),
    # so every later kernel and rank reuses it. Compiling all of site-packages at install took ~60 s of a fresh
    # `make test` here; the modules the course imports compile in ~7 s, once, on first use.
    cmd = [str(uv), "pip", "install", "--quiet", "--python", sys.executable,
           "--index-strategy", "unsafe-best-match", *options, *argv]
    if show:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
