"""Static checks of the Dockerfile's promises (tests/test_docker_image.py builds and runs it).

A base image chosen by build-arg whose CUDA matches the pinned torch, the README's install command,
a non-root user that an arbitrary uid can stand in for, the HF cache volume, a drain that fits
`docker stop`, the port, a health check on /health, the entrypoint.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
README = ROOT / "README.md"
# The CUDA each pinned torch is built for on PyPI (its wheel's `cuda-toolkit==13.0.*` requirement):
# bumping the pin means checking the new wheel's and moving BASE_IMAGE's CUDA with it.
TORCH_CUDA = {"2.13.0": "13.0"}
DOCKER_STOP_GRACE_S = 10  # `docker stop`'s default before SIGKILL


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        name, _, args = full.partition(" ")
        out.append((name.upper(), args.strip()))
    return out


def args_of(name: str) -> list[str]:
    return [args for instruction, args in instructions() if instruction == name]


def normalized_pip_install(command: str) -> list[str] | None:
    """`python -m pip install ".[x]"` -> ["pip", "install", ".[x]"]; None if not a pip install."""
    words = shlex.split(command)
    while words and words[0] in ("$", "python", "python3", "-m", "sudo"):
        words = words[1:]
    return words if words[:2] == ["pip", "install"] else None


def dockerfile_package_install() -> list[str]:
    installs = []
    for run in args_of("RUN"):
        for part in re.split(r"&&|;", run):
            words = normalized_pip_install(part.strip())
            if words and any(w.startswith(".") for w in words[2:]):
                installs.append(words)
    assert len(installs) == 1, f"expected one `pip install .[...]` of the package, found {installs}"
    return installs[0]


def arg_defaults() -> dict[str, str]:
    """ARG NAME=default -> {NAME: default} ("" for an ARG without a default)."""
    defaults = {}
    for arg in args_of("ARG"):
        name, _, default = arg.partition("=")
        defaults[name] = default.strip("\"'")
    return defaults


def env_values() -> dict[str, str]:
    return {
        name: value
        for env in args_of("ENV")
        for name, _, value in (word.partition("=") for word in shlex.split(env))
    }


def test_base_image_is_a_build_arg_matching_torchs_cuda():
    (base,) = args_of("FROM")
    assert base == "${BASE_IMAGE}", f"FROM {base}: the base must come from --build-arg BASE_IMAGE"
    default = arg_defaults()["BASE_IMAGE"]
    cuda = re.search(r":(\d+\.\d+)\.\d+-", default)
    assert cuda, f"BASE_IMAGE's default {default!r} names no CUDA version in its tag"
    torch_version = arg_defaults()["TORCH_VERSION"]
    assert TORCH_CUDA.get(torch_version) == cuda.group(1), (
        f"torch {torch_version} on PyPI is built for CUDA {TORCH_CUDA.get(torch_version)}; "
        f"the base image {default} has CUDA {cuda.group(1)}"
    )


def test_torch_is_pinned_as_in_the_readme_and_ci_in_its_own_layer():
    torch_version = arg_defaults()["TORCH_VERSION"]
    pin = f"torch=={torch_version}"
    assert pin in README.read_text(), f"README.md does not install {pin}"
    assert pin in (ROOT / ".ci" / "run").read_text(), f".ci/run does not install {pin}"
    runs = args_of("RUN")
    torch_run = next(i for i, run in enumerate(runs) if "torch==${TORCH_VERSION}" in run)
    (package_run,) = [i for i, run in enumerate(runs) if 'pip install "."' in run]
    assert torch_run < package_run, "torch's layer must come before (and apart from) the package's"
    assert "&&" not in runs[torch_run], "torch alone in its layer"


def test_readme_documents_the_base_and_the_driver_floor():
    text = README.read_text()
    default = arg_defaults()["BASE_IMAGE"]
    assert default in text, f"README.md does not name the default base image {default}"
    cuda = re.search(r":(\d+\.\d+)", default).group(1)
    assert re.search(rf"CUDA {re.escape(cuda)}\b", text) and "driver" in text.lower()


def test_drain_fits_docker_stop():
    from gemma4serve.cli import DRAIN_TIMEOUT_ENV, SHUTDOWN_BACKSTOP_S

    assert args_of("STOPSIGNAL") == ["SIGTERM"]
    drain = float(env_values()[DRAIN_TIMEOUT_ENV])
    assert drain + SHUTDOWN_BACKSTOP_S <= DOCKER_STOP_GRACE_S, (
        f"drain {drain}s + {SHUTDOWN_BACKSTOP_S}s to end aborted streams outlasts docker stop's "
        f"{DOCKER_STOP_GRACE_S}s grace: the container would be killed (exit 137)"
    )


def test_an_arbitrary_uid_in_group_0_can_write_every_cache():
    user, _, group = args_of("USER")[-1].partition(":")
    assert user.isdigit() and group == "0", "a numeric uid in group 0 (OpenShift's convention)"
    env = env_values()
    commands = [part.split() for run in args_of("RUN") for part in run.split("&&")]
    (writable,) = [words[3:] for words in commands if words[:3] == ["chmod", "-R", "g=u"]]
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "GEMMA4SERVE_CACHE"):
        assert name in env, f"{name} unset: an arbitrary uid has no home to fall back on"
        assert any(Path(env[name]).is_relative_to(folder) for folder in writable), (
            f"{name}={env[name]} is not under a folder made group-writable ({writable})"
        )


def test_installs_the_package_without_test_extras():
    words = dockerfile_package_install()
    (target,) = [w for w in words[2:] if w.startswith(".")]
    extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert extras, f"install the package itself, e.g. `pip install .`; got {target}"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    chosen = set(extras.group(1).split(",")) if extras.group(1) else set()
    assert chosen <= set(declared) and "test" not in chosen, (
        f"extras {chosen}: unknown, or the test extra"
    )


def test_install_command_equals_the_readme():
    if not README.exists():
        pytest.skip("README.md not written yet: nothing to compare the install command with")
    in_code, readme_installs = False, []
    for line in README.read_text().splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
        elif in_code and "pip install" in line:
            # `pip install ... && gemma4serve --demo`: each command on its own.
            for part in line.split("&&"):
                words = normalized_pip_install(part.strip())
                if words:
                    readme_installs.append(words)
    assert readme_installs, "README.md shows no `pip install` command in a code block"
    assert dockerfile_package_install() in readme_installs, (
        f"the Dockerfile installs with {shlex.join(dockerfile_package_install())!r}; "
        f"the README says {[shlex.join(w) for w in readme_installs]}"
    )


def test_every_package_folder_is_installed():
    """The image installs the package for real (not editable): a folder missing from
    pyproject's package list is left out and the server fails to import."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in ROOT.glob("gemma4serve/**/__init__.py")
    }
    assert folders <= listed, (
        f"pyproject.toml's [tool.setuptools] packages lacks {folders - listed}"
    )


def test_runs_as_non_root_after_installing():
    names = [n for n, _ in instructions()]
    users = args_of("USER")
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    last_user = len(names) - 1 - names[::-1].index("USER")
    last_run = len(names) - 1 - names[::-1].index("RUN")
    assert last_user > last_run, (
        "USER must come after the last RUN (the install steps need root, serving does not)"
    )


def test_hf_cache_volume():
    envs = " ".join(args_of("ENV"))
    assert re.search(r"\bHF_HOME=/cache/huggingface\b", envs), envs
    volumes = " ".join(args_of("VOLUME"))
    assert "/cache/huggingface" in volumes


def test_exposes_8000_and_checks_health():
    assert any("8000" in a.split() for a in args_of("EXPOSE"))
    (check,) = args_of("HEALTHCHECK")
    assert "/health" in check and ":8000/" in check and "NONE" not in check.split()


def test_entrypoint_is_the_console_script():
    (entrypoint,) = args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["gemma4serve"], (
        "exec form, so that SIGTERM reaches the server (drain, exit 0)"
    )
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gemma4serve"] == "gemma4serve.cli:main"
    (cmd,) = args_of("CMD")
    assert isinstance(json.loads(cmd), list)


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]  # fmt: skip
    assert ".git" in patterns
    for copy in args_of("COPY"):
        *sources, _dest = shlex.split(copy)
        for source in sources:
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in patterns), (
                f".dockerignore drops COPY source {source}"
            )
            if source == "README.md" and not README.exists():
                # test_install_command_equals_the_readme skips while there is no README.
                continue
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
