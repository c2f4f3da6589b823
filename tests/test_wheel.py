"""The README is an entry point that works as written: its `pip install` line installs the
wheel built from this checkout into a fresh virtual environment, and its two quick starts,
taken from the README's own text, run there, commit checkpoints, and resume.

The new environment reuses this suite's dependencies, so the test needs no network and no
torch download: a `.pth` file adds a copy of this environment's site-packages (links to every
entry but aoffload's own, so that nothing there shadows the wheel) after the new one's own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200
INSTALL = "Install"
SYNC = "Quick start: a synchronous trainer"
ASYNC = "Quick start: an asyncio trainer"
EXTRAS = {"deepspeed", "lightning", "s3", "uvloop"}
"""The extras the Install section names (issue #36)."""


def sections(text: str) -> dict[str, str]:
    """The README's ``## `` sections by heading, in order."""
    found: dict[str, str] = {}
    for part in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        heading, _, body = part.partition("\n")
        found[heading.strip()] = body
    return found


def code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)


def quick_start(heading: str) -> str:
    blocks = code_blocks(sections(README.read_text(encoding="utf-8"))[heading], "python")
    assert len(blocks) == 1, f"README section {heading!r}: one python block, not {len(blocks)}"
    return blocks[0]


def pip_install_line() -> list[str]:
    """The Install section's `pip install` line for aoffload, as arguments (after `pip`)."""
    install = sections(README.read_text(encoding="utf-8"))[INSTALL]
    lines = [
        shlex.split(line, comments=True)
        for block in code_blocks(install, "bash")
        for line in block.splitlines()
    ]
    ours = [w for w in lines if w[:2] == ["pip", "install"] and any(_is_ours(a) for a in w)]
    assert len(ours) == 1, f"the Install section has one `pip install` line for aoffload: {ours}"
    return ours[0][1:]


def _is_ours(argument: str) -> bool:
    return re.fullmatch(r"aoffload(\[[a-z0-9_,-]+\])?", argument) is not None


# -- the README's shape (no wheel needed) -------------------------------------------------


def test_the_readme_is_an_entry_point_of_at_most_200_lines() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    headings = list(sections(text))
    for heading in (INSTALL, SYNC, ASYNC):
        assert heading in headings, f"the README has no '## {heading}' section"
    assert headings.index(INSTALL) < headings.index(SYNC) < headings.index(ASYNC)
    for heading in (SYNC, ASYNC):
        assert len(quick_start(heading).splitlines()) < 25, heading


def test_the_install_line_names_the_extras_that_exist() -> None:
    (requirement,) = [a for a in pip_install_line() if _is_ours(a)]
    named = set(requirement.partition("[")[2].rstrip("]").split(","))
    assert named == EXTRAS
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert named <= set(declared["project"]["optional-dependencies"])


def test_the_synchronous_quick_start_has_no_asyncio_in_it() -> None:
    code = quick_start(SYNC)
    for word in ("asyncio", "await", "async "):
        assert word not in code


# -- the wheel, installed by the README's line ----------------------------------------------


@dataclass(frozen=True)
class Installed:
    python: Path
    bin: Path
    site_packages: Path
    env: dict[str, str]

    def run(self, *args: str | Path, cwd: Path) -> str:
        done = self._run(args, cwd)
        assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        assert done.stderr == "", f"{args} said on stderr:\n{done.stderr}"
        return done.stdout

    def fails(self, *args: str | Path, cwd: Path) -> str:
        """Run it, expecting it to fail; its stderr."""
        done = self._run(args, cwd)
        assert done.returncode != 0, f"{args} did not fail:\n{done.stdout}{done.stderr}"
        return done.stderr

    def _run(self, args: tuple[str | Path, ...], cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args], cwd=cwd, env=self.env, capture_output=True, text=True,
            timeout=180, check=False,
        )  # fmt: skip


def _clean_env() -> dict[str, str]:
    """This environment without what would point at the checkout or at a package index."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"} and not k.startswith("PIP_")
    }
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, find-links or constraints from pip.conf
    env["PIP_NO_INPUT"] = "1"
    return env


def _shared_site_packages(into: Path) -> Path:
    """Links to every entry of this environment's site-packages but aoffload's own."""
    into.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if "aoffload" not in entry.name.lower():
            (into / entry.name).symlink_to(entry)
    return into


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the checkout.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "aoffload", source / "aoffload", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = _clean_env()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
         "--wheel-dir", str(work / "dist"), str(source)],
        env=env, check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    (wheel,) = (work / "dist").glob("aoffload-*.whl")

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(python), "-c", where], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    shared = _shared_site_packages(work / "shared-site-packages")
    (site / "zz-aoffload-test-suite.pth").write_text(
        f"import site; site.addsitedir({str(shared)!r})\n", encoding="utf-8"
    )
    # The README's line, with the wheel in place of the package name; pip itself comes from
    # the shared site-packages and installs into the new environment.
    args = [
        f"{wheel}{a.removeprefix('aoffload')}" if _is_ours(a) else a for a in pip_install_line()
    ]
    done = subprocess.run(
        [str(python), "-m", "pip", *args, "--no-index", "--no-warn-script-location"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Successfully installed aoffload-" in done.stdout, done.stdout
    return Installed(python=python, bin=venv / "bin", site_packages=site, env=env)


def test_aoffload_comes_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    where = installed.run(
        installed.python, "-c", "import aoffload; print(aoffload.__file__)", cwd=tmp_path
    )
    assert Path(where.strip()).is_relative_to(installed.site_packages), where
    assert (installed.bin / "aoffload").is_file()  # the console script


def _committed(installed: Installed, directory: Path) -> str:
    """The tag ``latest`` names, after ``aoffload verify`` (the wheel's command) passed."""
    installed.run(installed.bin / "aoffload", "verify", directory, cwd=directory.parent)
    return (directory / "latest").read_text(encoding="utf-8").strip()


def test_the_synchronous_quick_start_runs_and_resumes(installed: Installed, tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start(SYNC), encoding="utf-8")
    first = installed.run(installed.python, script, cwd=tmp_path)
    assert "training from step 0" in first, first
    assert _committed(installed, tmp_path / "checkpoints") == "step-20"
    # The resume really loads, verified: from a copy whose file is corrupt, it fails.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp_path / "checkpoints", corrupt / "checkpoints")
    with (corrupt / "checkpoints" / "step-20" / "state.pt").open("r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 0xFF]))
    said = installed.fails(installed.python, script, cwd=corrupt)
    assert "CorruptCheckpointError" in said, said
    assert "state.pt" in said, said
    second = installed.run(installed.python, script, cwd=tmp_path)
    assert "training from step 20" in second, second  # resumed from latest
    assert _committed(installed, tmp_path / "checkpoints") == "step-40"


def test_the_asyncio_quick_start_runs_and_resumes(installed: Installed, tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start(ASYNC), encoding="utf-8")
    installed.run(installed.python, script, cwd=tmp_path)
    assert _committed(installed, tmp_path / "checkpoints") == "step-20"
    installed.run(installed.python, script, cwd=tmp_path)  # resumes: its new tags go on
    assert _committed(installed, tmp_path / "checkpoints") == "step-40"
