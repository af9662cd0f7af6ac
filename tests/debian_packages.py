"""Install Debian packages that end-to-end tests need when this machine lacks them (CI machines
start without Docker or nginx; the tests may install them, as root)."""

from __future__ import annotations

import os
import shutil
import subprocess


def install_missing(tools: dict[str, str]) -> None:
    """apt-get install the package of every tool (command name -> Debian package) not on PATH."""
    missing = sorted({package for tool, package in tools.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"these tests need {', '.join(missing)}: apt-get install them (as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"apt-get install {' '.join(missing)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
